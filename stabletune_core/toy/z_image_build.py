"""The toy Z-Image base's part of the transformer families' toy build (toy/flow_build.py): its components and the
statistics its latents are normalised with (the normalisation is the family's, ZImage.normalize_raw_latents).

    python -m stabletune_core.toy build --family z_image [--out DIR] [--vae-steps N] [--unet-steps N]

An AutoencoderKL in FLUX.1's arrangement (Z-Image's VAE) whose shift and scaling factors are the mean and inverse
standard deviation of the toy world's latents, a ZImageTransformer2DModel as wide as the toy Klein's transformer,
the tiny Qwen3 of models/flux2_klein/tiny.py (frozen, as Z-Image's text encoder is; Z-Image reads its second-to-last
hidden state) and Z-Image's scheduler (a static shift of 3).
"""
from __future__ import annotations

import functools

import torch

from . import z_image as toy_z_image
from .build import BUILD_SEED, loud_token_embeddings
from .flow_build import FlowToy, Recipe
from .flow_build import build as build_flow_toy

WEIGHTS = toy_z_image.WEIGHTS
#: Wider than the tests' random tiny Z-Image (models/z_image/tiny.py), as the toy Klein's VAE is (build.py's
#: TOY_VAE_CONFIG says why: one channel per norm group erases colour ratios; four per group keep colours apart).
TOY_VAE_CONFIG = dict(block_out_channels=(16, 32, 32, 32), norm_num_groups=4)
#: 64 wide (4 heads of 16, the head's rope axes as the tiny one's), as the toy Klein's transformer.
TOY_TRANSFORMER_CONFIG = dict(dim=64, n_heads=4, n_kv_heads=4)
#: Trained at the unshifted table (flow_shift 1, where the toy Klein trains, its scheduler shifting only at sampling)
#: rather than Z-Image's static shift 3, at 4e-3 for 8500 steps. With the first base's codec, 2000 steps, 4 seeds per
#: prompt (bench/RESULTS.md, "The toy Z-Image base, rebuilt"): shift 3 at 2e-3 draws 58 % of shapes right, shift 1
#: 69 %, shift 1 at 4e-3 67 % (a lower loss); 6000 steps at shift 3 and 2e-3 drew 79 % (squares round).
RECIPE = Recipe(vae_steps=1500, vae_batch=16, transformer_steps=8500, transformer_batch=32, transformer_lr=4e-3,
                scenes_per_combo=256, eval_seeds=8, ema_max_decay=0.998, evaluate_every=2500, flow_shift=1.0)


def toy_components(seed: int = BUILD_SEED) -> dict:
    """transformer, vae, text_encoder, tokenizer, scheduler of the toy Z-Image at initialisation (deterministic)."""
    from diffusers import AutoencoderKL, ZImageTransformer2DModel

    from ..models.z_image.tiny import TRANSFORMER_CONFIG, VAE_CONFIG, build_tiny_z_image_components

    parts = build_tiny_z_image_components(seed)  # the frozen random Qwen3, its tokenizer, Z-Image's scheduler
    loud_token_embeddings(parts["text_encoder"], seed)
    torch.manual_seed(seed + 11)
    parts["transformer"] = ZImageTransformer2DModel(**{**TRANSFORMER_CONFIG, **TOY_TRANSFORMER_CONFIG})
    torch.manual_seed(seed + 12)
    parts["vae"] = AutoencoderKL(**{**VAE_CONFIG, **TOY_VAE_CONFIG})
    return parts


def bundle_of(parts: dict):
    """The family's ModelBundle over in-memory parts, so the build encodes and trains as a LoRA run does."""
    from ..models.base import ModelBundle
    from ..models.z_image.family import Distillation, ZImage

    return ModelBundle(family=ZImage(), denoiser=parts["transformer"], vae=parts["vae"],
                       text_encoders=[parts["text_encoder"]], tokenizers=[parts["tokenizer"]],
                       noise_scheduler=parts["scheduler"], source="toy-z-image",
                       extra={"source_kind": "folder", "distillation": Distillation("base", "the toy build trains "
                              "the base"), "max_sequence_length": toy_z_image.TEXT_LENGTH})


def set_latent_statistics(vae, raw: torch.Tensor) -> None:
    """The VAE's shift and scaling factors (Z-Image normalises (z - shift) x scale, one number each): the toy
    world's latents' mean and inverse standard deviation."""
    vae.register_to_config(shift_factor=round(float(raw.mean()), 5), scaling_factor=round(float(1 / raw.std()), 5))


TOY_Z_IMAGE = FlowToy(family="z_image", recipe=RECIPE, text_length=toy_z_image.TEXT_LENGTH,
                      components=toy_components, bundle_of=bundle_of, set_latent_statistics=set_latent_statistics,
                      pipeline_of=toy_z_image.pipeline_of, materialize=toy_z_image.materialize,
                      load_pipeline=toy_z_image.load_toy_z_image_pipeline)

#: build(out, **numbers): train the toy Z-Image base (RECIPE, less the numbers given; log=) and write its shipped files
#: and manifest into `out`.
build = functools.partial(build_flow_toy, toy=TOY_Z_IMAGE)
