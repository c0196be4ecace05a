"""The toy FLUX.2 Klein base: a tiny real-layout Klein trained on the toy world (klein_build.py), shipped in fp16.

`toy_klein_model()` returns a Klein diffusers folder (in the user cache, built from the weights shipped in
`weights_flux2/`) that the flux2_klein family loads like any Klein base model; `load_toy_klein_pipeline` is the
Flux2KleinPipeline the toy judge (evaluate.py) renders with, at the toy's TEXT_LENGTH (toy/flow_base.py says why).
"""
from __future__ import annotations

import json
from pathlib import Path

from .flow_base import TEXT_LENGTH, check_shipped, in_memory_pipeline, load_flow_pipeline, materialize_flow_base, plain

WEIGHTS = Path(__file__).resolve().parent / "weights_flux2"
__all__ = ["TEXT_LENGTH", "WEIGHTS", "load_toy_klein_pipeline", "materialize", "pipeline_of", "toy_klein_model"]


def toy_klein_model(weights: Path = WEIGHTS) -> Path:
    """The shipped toy Klein base as a diffusers folder (built once per weights version, in the cache)."""
    check_shipped(weights, "The toy Klein", "flux2_klein")
    return materialize(weights)


def _modules(configs: dict) -> dict:
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return {"transformer": Flux2Transformer2DModel(**plain(configs["transformer"])),
            "vae": AutoencoderKLFlux2(**plain(configs["vae"])),
            "text_encoder": Qwen3ForCausalLM(Qwen3Config(**configs["text_encoder"]))}


def _model_index() -> dict:
    import diffusers

    from ..models.flux2_klein.family import SHIPPED_CONFIGS

    index = json.loads((SHIPPED_CONFIGS["4b"] / "model_index.json").read_text())
    index.update(_diffusers_version=diffusers.__version__, is_distilled=False)
    return index


def materialize(weights: Path, target: Path | None = None) -> Path:
    """Write a Klein diffusers folder (fp32, tokenizer included, is_distilled false) from the fp16 weights."""
    return materialize_flow_base(weights, target, prefix="toy-klein", label="The toy Klein", modules=_modules,
                                 model_index=_model_index)


def load_toy_klein_pipeline(model: Path):
    """A Flux2KleinPipeline (the base: classifier-free guidance) over a toy Klein diffusers folder, at the toy's
    text length."""
    from diffusers import Flux2KleinPipeline

    return load_flow_pipeline(Flux2KleinPipeline, model)


def pipeline_of(parts: dict):
    """A Flux2KleinPipeline over in-memory parts (the build's evaluations)."""
    from diffusers import Flux2KleinPipeline

    return in_memory_pipeline(Flux2KleinPipeline, parts, is_distilled=False)
