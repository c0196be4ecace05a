"""StableTune: LoRA training for Stable Diffusion that finishes."""
__version__ = "0.1.0"
