"""A tiny Z-Image with the real layout and random weights, for tests: built offline, in seconds, from a seed.

Every part is the class ``ZImagePipeline`` loads, only narrow: a ZImageTransformer2DModel with two main layers and
the two noise and two context refiner layers of the released model (ComfyUI's key map assumes two of each), an
AutoencoderKL in FLUX.1's arrangement (Z-Image's VAE: no quant convs, scaling and shift factors; not the FLUX.2 VAE
with its latent batch norm), the tiny Qwen3 text encoder and byte-level tokenizer of models/qwen3_text.py (Z-Image and
FLUX.2 Klein 4B read the same Qwen3-4B), and a FlowMatchEulerDiscreteScheduler with a static shift of 3.
64 px images are 8 x 8 VAE latents, 4 x 4 = 16 image tokens after the transformer's own 2 x 2 patchify.

Turbo and Base share every config (the weights differ), so a tiny Turbo is the same model in a folder named as
Tongyi-MAI names the distilled one (``Z-Image-Turbo``); models/z_image/family.py tells them apart by that name.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..qwen3_text import TEXT_HIDDEN, build_tiny_tokenizer, text_encoder_config

TINY_IMAGE_SIZE = 64

TRANSFORMER_CONFIG = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=4,  # the tiny VAE's latent channels (16 in the released model)
    dim=32,
    n_layers=2,
    n_refiner_layers=2,
    n_heads=2,
    n_kv_heads=2,
    norm_eps=1e-5,
    qk_norm=True,
    cap_feat_dim=TEXT_HIDDEN,  # the Qwen3 hidden size (2560 for Qwen3-4B)
    rope_theta=256.0,
    t_scale=1000.0,
    axes_dims=[4, 6, 6],  # sums to the head dim, 32 / 2
    axes_lens=[1024, 512, 512],
)
VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(8, 16, 16, 16),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=8,
    sample_size=TINY_IMAGE_SIZE,
    scaling_factor=0.3611,  # FLUX.1's VAE, which Z-Image uses
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
#: Z-Image-Turbo's scheduler_config.json: a static shift, no dynamic shifting.
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)


def build_tiny_z_image_components(seed: int = 0) -> dict:
    """transformer, vae, text_encoder, tokenizer, scheduler of the tiny Z-Image, in memory, deterministic."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(seed)
    transformer = ZImageTransformer2DModel(**TRANSFORMER_CONFIG)
    g = torch.Generator().manual_seed(seed + 10)
    with torch.no_grad():  # the released model's final layer is not zero; a zero one would hide every LoRA
        for p in transformer.parameters():
            if p.abs().sum() == 0:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(**VAE_CONFIG)
    torch.manual_seed(seed + 3)
    text_encoder = Qwen3ForCausalLM(Qwen3Config(**text_encoder_config(tokenizer)))
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)
    for m in (transformer, vae, text_encoder):
        m.eval()
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
            "scheduler": scheduler}


def build_tiny_z_image(out_dir: Path, seed: int = 0) -> Path:
    """Write a complete tiny Z-Image diffusers folder (as Tongyi-MAI/Z-Image lays it out) and return its path; name
    the folder ``...Turbo...`` for a tiny Turbo."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = build_tiny_z_image_components(seed)
    for name in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        parts[name].save_pretrained(str(out_dir / name))
    (out_dir / "model_index.json").write_text(json.dumps(model_index(), indent=2))
    return out_dir


def model_index() -> dict:
    """The model_index.json of a Z-Image diffusers folder (Tongyi-MAI/Z-Image's classes)."""
    import diffusers

    return {"_class_name": "ZImagePipeline", "_diffusers_version": diffusers.__version__,
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "text_encoder": ["transformers",
            "Qwen3ForCausalLM"], "tokenizer": ["transformers", "Qwen2TokenizerFast"],
            "transformer": ["diffusers", "ZImageTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"]}
