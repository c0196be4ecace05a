"""LoRA: inject (peft), export (kohya/A1111 and diffusers formats), spectra."""
