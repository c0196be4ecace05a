"""The toy Z-Image base: a tiny real-layout Z-Image trained on the toy world (z_image_build.py), shipped in fp16.

`toy_z_image_model()` returns a Z-Image diffusers folder (in the user cache, built from the weights shipped in
`weights_z_image/`) that the z_image family loads like any Z-Image Base model (the folder's name says Z-Image, not
Turbo); `load_toy_z_image_pipeline` is the ZImagePipeline the toy judge (evaluate.py) renders with, at the toy's
TEXT_LENGTH (toy/flow_base.py says why).
"""
from __future__ import annotations

from pathlib import Path

from .flow_base import TEXT_LENGTH, check_shipped, in_memory_pipeline, load_flow_pipeline, materialize_flow_base, plain

WEIGHTS = Path(__file__).resolve().parent / "weights_z_image"
__all__ = ["TEXT_LENGTH", "WEIGHTS", "load_toy_z_image_pipeline", "materialize", "pipeline_of", "toy_z_image_model"]


def toy_z_image_model(weights: Path = WEIGHTS) -> Path:
    """The shipped toy Z-Image base as a diffusers folder (built once per weights version, in the cache)."""
    check_shipped(weights, "The toy Z-Image", "z_image")
    return materialize(weights)


def _modules(configs: dict) -> dict:
    from diffusers import AutoencoderKL, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return {"transformer": ZImageTransformer2DModel(**plain(configs["transformer"])),
            "vae": AutoencoderKL(**plain(configs["vae"])),
            "text_encoder": Qwen3ForCausalLM(Qwen3Config(**configs["text_encoder"]))}


def _model_index() -> dict:
    from ..models.z_image.tiny import model_index

    return model_index()


def materialize(weights: Path, target: Path | None = None) -> Path:
    """Write a Z-Image diffusers folder (fp32, tokenizer included) from the fp16 weights; its default name,
    toy-z-image-VERSION, is one the z_image family reads as Base (models/z_image/family.py detect_distillation)."""
    return materialize_flow_base(weights, target, prefix="toy-z-image", label="The toy Z-Image", modules=_modules,
                                 model_index=_model_index)


def load_toy_z_image_pipeline(model: Path):
    """A ZImagePipeline (classifier-free guidance) over a toy Z-Image diffusers folder, at the toy's text length."""
    from diffusers import ZImagePipeline

    return load_flow_pipeline(ZImagePipeline, model)


def pipeline_of(parts: dict):
    """A ZImagePipeline over in-memory parts (the build's evaluations)."""
    from diffusers import ZImagePipeline

    return in_memory_pipeline(ZImagePipeline, parts)
