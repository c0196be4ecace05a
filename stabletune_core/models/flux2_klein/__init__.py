"""FLUX.2 Klein (4B / 9B): everything this family knows, in one folder.

family.py (the family: load from a diffusers folder or ComfyUI's files, latents, Qwen3 text, LoRA presets,
detection), single_file.py (BFL's checkpoint layout and its conversions), lora.py (the LoRA file's BFL / LyCORIS
names and the q/k/v fusing), memory.py (the training-memory model), tiny.py (a tiny real-layout Klein for the
tests), configs/ (the shipped 4B / 9B configs). The knob rules and the file detection the config and the UI read
without torch are config/families.py's: importing this package runs models/__init__.py, which imports torch.
"""
