"""Stable Diffusion 1.x, 2.x and XL: everything these families know, in one folder.

sd1.py (the SD 1.x family: load, latents, CLIP text, LoRA targets, metadata), sd2.py and sdxl.py (what each
changes), single_file.py (the original CompVis / SGM / OpenCLIP checkpoint layout and its conversions, kohya's SGM
LoRA names), sdxl_memory.py (SDXL's training-memory model), tiny.py (tiny real-layout models for the tests),
configs/ (the shipped diffusers configs a single file is read with). The knob rules the config and the UI read
without torch are config/families.py's: importing this package runs models/__init__.py, which imports torch.
"""
