"""The toy FLUX.2 Klein base's part of the transformer families' toy build (toy/flow_build.py): its components and
the statistics its latents are normalised with (the normalisation is the family's, Flux2Klein.normalize_raw_latents).

    python -m stabletune_core.toy build --family flux2_klein [--out DIR] [--vae-steps N] [--unet-steps N]

An AutoencoderKLFlux2 codec whose latent batch norm gets the statistics of the toy world's patchified latents, a
Flux2Transformer2DModel of two double and two single blocks, the tiny Qwen3 of models/flux2_klein/tiny.py (frozen,
as Klein's text encoder is) and Klein's scheduler.
"""
from __future__ import annotations

import functools

import torch

from . import klein as toy_klein
from .build import BUILD_SEED, loud_token_embeddings
from .flow_build import FlowToy, Recipe
from .flow_build import build as build_flow_toy

WEIGHTS = toy_klein.WEIGHTS
#: Wider than the tests' random tiny Klein (models/flux2_klein/tiny.py), for the reason build.py's TOY_VAE_CONFIG gives:
#: one channel per norm group erases colour ratios; four per group keep colours apart.
TOY_VAE_CONFIG = dict(block_out_channels=(16, 32, 32, 32), norm_num_groups=4)
TOY_TRANSFORMER_CONFIG = dict(num_attention_heads=4)  # 64 wide (4 heads of 16); two double, two single blocks
#: The shipped v3 base's numbers (weights_flux2/manifest.json): 1500 codec steps, 10000 transformer steps of 32.
RECIPE = Recipe(vae_steps=1500, vae_batch=16, transformer_steps=10000, transformer_batch=32, transformer_lr=2e-3,
                scenes_per_combo=256, eval_seeds=8, ema_max_decay=0.998, evaluate_every=2500)


def toy_components(seed: int = BUILD_SEED) -> dict:
    """transformer, vae, text_encoder, tokenizer, scheduler of the toy Klein at initialisation (deterministic)."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    from ..models.flux2_klein.tiny import TRANSFORMER_CONFIG, VAE_CONFIG, build_tiny_klein_components

    parts = build_tiny_klein_components(seed)  # the frozen random Qwen3, its tokenizer, Klein's scheduler
    loud_token_embeddings(parts["text_encoder"], seed)
    torch.manual_seed(seed + 11)
    parts["transformer"] = Flux2Transformer2DModel(**{**TRANSFORMER_CONFIG, **TOY_TRANSFORMER_CONFIG})
    torch.manual_seed(seed + 12)
    parts["vae"] = AutoencoderKLFlux2(**{**VAE_CONFIG, **TOY_VAE_CONFIG})
    return parts


def bundle_of(parts: dict):
    """The family's ModelBundle over in-memory parts, so the build encodes and trains as a LoRA run does."""
    from ..models.base import ModelBundle
    from ..models.flux2_klein.family import Distillation, Flux2Klein, use_klein_chat_template

    use_klein_chat_template(parts["tokenizer"])
    return ModelBundle(family=Flux2Klein(), denoiser=parts["transformer"], vae=parts["vae"],
                       text_encoders=[parts["text_encoder"]], tokenizers=[parts["tokenizer"]],
                       noise_scheduler=parts["scheduler"], source="toy-klein",
                       extra={"distillation": Distillation("base", "the toy build trains the base"),
                              "max_sequence_length": toy_klein.TEXT_LENGTH})


def set_latent_statistics(vae, raw: torch.Tensor) -> None:
    """Give the VAE's latent batch norm the mean and variance of the toy world's patchified latents."""
    from ..models.flux2_klein.family import patchify

    packed = patchify(raw)
    vae.bn.running_mean.copy_(packed.mean(dim=(0, 2, 3)))
    vae.bn.running_var.copy_(packed.var(dim=(0, 2, 3)))


TOY_KLEIN = FlowToy(family="flux2_klein", recipe=RECIPE, text_length=toy_klein.TEXT_LENGTH,
                    components=toy_components, bundle_of=bundle_of, set_latent_statistics=set_latent_statistics,
                    pipeline_of=toy_klein.pipeline_of, materialize=toy_klein.materialize,
                    load_pipeline=toy_klein.load_toy_klein_pipeline)

#: build(out, **numbers): train the toy Klein base (RECIPE, less the numbers given; log=) and write its shipped files
#: and manifest into `out`.
build = functools.partial(build_flow_toy, toy=TOY_KLEIN)
