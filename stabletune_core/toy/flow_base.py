"""What every transformer family's toy base (toy/klein.py, toy/z_image.py) does the same way: its shipped fp16
weights become a diffusers folder in the user cache, and its pipeline samples at the toy's text length.

The toy's prompts ("a purple triangle") are 14-21 Qwen3 tokens with the families' chat templates, so the toy bases are
built, sampled and taught at TEXT_LENGTH tokens instead of the pipelines' 512 (the config's max_sequence_length; the
demo presets set the same): the transformer then attends over 16 image + 32 text tokens, not 528, and a training
step costs about a tenth.
"""
from __future__ import annotations

import functools
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Callable

from ..atomic import atomic_path
from ..cache import cache_root

#: The toy bases' text length (max_sequence_length): the longest toy prompt with a template is 21 tokens.
TEXT_LENGTH = 32


def plain(config: dict) -> dict:
    """A saved diffusers config without its private keys (_class_name, _use_default_values, ...)."""
    return {k: v for k, v in config.items() if not k.startswith("_")}


def check_shipped(weights: Path, label: str, family: str) -> None:
    """One sentence when a toy base's shipped weights are missing (`label`: 'The toy Klein', ...)."""
    if not (weights / "manifest.json").is_file():
        raise FileNotFoundError(f"{label} base weights are missing from {weights}; rebuild them with "
                                f"`python -m stabletune_core.toy build --family {family}`.")


def materialize_flow_base(weights: Path, target: Path | None, *, prefix: str, label: str,
                          modules: Callable[[dict], dict[str, Any]], model_index: Callable[[], dict]) -> Path:
    """Write a diffusers folder (fp32, tokenizer included) from a toy base's fp16 weights: `modules(configs)` gives
    its transformer, vae and text_encoder (a Qwen3, whose tied lm_head is not shipped) from the shipped configs,
    `model_index()` the folder's model_index.json; the scheduler is a FlowMatchEulerDiscreteScheduler. The folder
    is `target`, else `prefix`-VERSION in the cache (VERSION: the configs and the transformer's weights)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler
    from safetensors.torch import load_file

    configs_text = (weights / "configs.json").read_bytes()
    version = hashlib.sha256(configs_text + (weights / "transformer.safetensors").read_bytes()).hexdigest()[:12]
    target = target or cache_root() / f"{prefix}-{version}"
    if (target / "model_index.json").is_file():
        return target
    configs = json.loads(configs_text)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_path(target, folder=True) as staging:
            for name, module in modules(configs).items():
                state = {k: v.to(torch.float32) for k, v in load_file(str(weights / f"{name}.safetensors")).items()}
                missing, unexpected = module.load_state_dict(state, strict=False)
                if unexpected or set(missing) - {"lm_head.weight"}:  # Qwen3's lm_head is tied, not shipped
                    raise ValueError(f"{label}'s {name} weights do not fit its config "
                                     f"(missing {missing[:3]}, unexpected {unexpected[:3]}).")
                if name == "text_encoder":
                    module.tie_weights()
                module.save_pretrained(staging / name)
            FlowMatchEulerDiscreteScheduler(**plain(configs["scheduler"])).save_pretrained(staging / "scheduler")
            shutil.copytree(weights / "tokenizer", staging / "tokenizer")
            (staging / "model_index.json").write_text(json.dumps(model_index(), indent=2))
    except OSError:
        if not (target / "model_index.json").is_file():
            raise
        # another process materialised it first; its copy is the same
    return target


@functools.cache
def text_length_pipeline(pipeline_class: type) -> type:
    """`pipeline_class` whose prompts are encoded at TEXT_LENGTH unless a call says otherwise, so every renderer of a
    toy base (evaluate.render, the demo's prior images, tests) samples at the length it was trained with, without
    being told."""

    class ToyPipeline(pipeline_class):
        def __call__(self, *args, max_sequence_length: int = TEXT_LENGTH, **kwargs):
            return super().__call__(*args, max_sequence_length=max_sequence_length, **kwargs)

    ToyPipeline.__name__ = ToyPipeline.__qualname__ = f"Toy{pipeline_class.__name__}"
    return ToyPipeline


def load_flow_pipeline(pipeline_class: type, model: Path):
    """The toy pipeline (classifier-free guidance, the toy's text length) over a toy base's diffusers folder."""
    pipe = text_length_pipeline(pipeline_class).from_pretrained(str(model), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def in_memory_pipeline(pipeline_class: type, parts: dict, **extra: Any):
    """The toy pipeline over in-memory parts (the build's evaluations), with its own copy of the scheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe = text_length_pipeline(pipeline_class)(
        scheduler=FlowMatchEulerDiscreteScheduler.from_config(parts["scheduler"].config), vae=parts["vae"],
        text_encoder=parts["text_encoder"], tokenizer=parts["tokenizer"], transformer=parts["transformer"], **extra)
    pipe.set_progress_bar_config(disable=True)
    return pipe
