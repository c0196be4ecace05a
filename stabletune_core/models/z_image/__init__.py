"""Z-Image (Base / Turbo): everything this family knows, in one folder.

family.py (the family: load, latents, Qwen3 text, LoRA presets and key names, detection), single_file.py (the
original single-file layout and its converter), adapter.py (a training adapter merged while training), tiny.py (a tiny
real-layout Z-Image for the tests). The knob rules the config and the UI read without torch are
config/families.py's: importing this package runs models/__init__.py, which imports torch.
"""
