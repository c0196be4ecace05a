"""kohya / A1111 LoRA key names.

kohya's sd-scripts name every LoRA module after its module path with dots
replaced by underscores, under ``lora_unet_`` or ``lora_te_`` (SDXL:
``lora_te1_`` / ``lora_te2_``). For SD 1.x/2.x the UNet path is the diffusers
one; for SDXL it is the original SGM one (``input_blocks_4_1_...``), because
kohya's SDXL UNet uses those names (models/sd/single_file.py ``kohya_sgm_unet_name``; each family's
``kohya_denoiser_name`` says which). A1111, Forge, ComfyUI and diffusers all map
these names back to their own layouts, so this is the one format they share.

Text encoder names always carry ``text_model_``: transformers >= 5.6 flattened
``CLIPTextModel`` (its modules are ``encoder.layers.N...``), while every
consumer still expects ``lora_te_text_model_encoder_layers_N_...``.
"""
from __future__ import annotations

UNET_PREFIX = "lora_unet"
TEXT_MODEL = "text_model."

DOWN = "lora_down.weight"
UP = "lora_up.weight"
ALPHA = "alpha"
DORA_SCALE = "dora_scale"  # a DoRA layer's magnitude, per input channel: (1, in) or (1, in, 1, 1)


def _flat(module_path: str) -> str:
    return module_path.replace(".", "_")


def kohya_unet_name(module_path: str) -> str:
    """``down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0`` -> ``lora_unet_down_blocks_0_..._to_out_0``."""
    return f"{UNET_PREFIX}_{_flat(module_path)}"


def text_model_path(module_path: str) -> str:
    """The module path as pre-5.6 transformers named it (always under ``text_model.``)."""
    return module_path if module_path.startswith(TEXT_MODEL) else TEXT_MODEL + module_path


def kohya_te_name(module_path: str, prefix: str = "lora_te") -> str:
    """``encoder.layers.0.self_attn.q_proj`` (or ``text_model.encoder...``) -> ``lora_te_text_model_encoder_layers_0_self_attn_q_proj``."""
    return f"{prefix}_{_flat(text_model_path(module_path))}"


def module_and_part(key: str) -> tuple[str, str]:
    """(module name, part) of a LoRA file's key: a part is one name (alpha, dora_scale, hada_w1_a, lokr_w1) or two
    ending in .weight (lora_down.weight, lora_A.weight); the module name before it may hold dots (a FLUX.2 LoKr's
    transformer.<path>, a diffusers-format file's path)."""
    module, *part = key.rsplit(".", 2 if key.endswith(".weight") else 1)
    return module, ".".join(part)


def kohya_keys(name: str) -> tuple[str, str, str]:
    """(down, up, alpha) tensor keys of one kohya LoRA module."""
    return f"{name}.{DOWN}", f"{name}.{UP}", f"{name}.{ALPHA}"
