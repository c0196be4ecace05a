"""The toy FLUX.2 Klein base: a tiny real-layout Klein trained on the toy world (klein_build.py), shipped in fp16.

`toy_klein_model()` returns a Klein diffusers folder (in the user cache, built from the weights shipped in
`weights_flux2/`) that the flux2_klein family loads like any Klein base model; `load_toy_klein_pipeline` is the
Flux2KleinPipeline the toy judge (evaluate.py) renders with.

The toy's prompts ("a purple triangle") are 14-21 Qwen3 tokens with Klein's chat template, so the toy base is
built, sampled and taught at TEXT_LENGTH tokens instead of the pipeline's 512 (the config's max_sequence_length;
presets/demo-flux2-klein.toml sets the same): the transformer then attends over 16 image + 32 text tokens, not 528,
and a training step costs about a tenth.
"""
from __future__ import annotations

import functools
import hashlib
import json
import shutil
from pathlib import Path

from ..atomic import atomic_path
from ..cache import cache_root

WEIGHTS = Path(__file__).resolve().parent / "weights_flux2"
#: The toy Klein's text length (max_sequence_length): the longest toy prompt with the template is 21 tokens.
TEXT_LENGTH = 32


def toy_klein_model(weights: Path = WEIGHTS) -> Path:
    """The shipped toy Klein base as a diffusers folder (built once per weights version, in the cache)."""
    if not (weights / "manifest.json").is_file():
        raise FileNotFoundError(f"The toy Klein base weights are missing from {weights}; rebuild them with "
                                "`python -m stabletune_core.toy build --family flux2_klein`.")
    return materialize(weights)


def materialize(weights: Path, target: Path | None = None) -> Path:
    """Write a Klein diffusers folder (fp32, tokenizer included, is_distilled false) from the fp16 weights."""
    import diffusers
    import torch
    from safetensors.torch import load_file

    configs_text = (weights / "configs.json").read_bytes()
    version = hashlib.sha256(configs_text + (weights / "transformer.safetensors").read_bytes()).hexdigest()[:12]
    target = target or cache_root() / f"toy-klein-{version}"
    if (target / "model_index.json").is_file():
        return target
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from ..models.flux2_klein.family import SHIPPED_CONFIGS

    configs = json.loads(configs_text)

    def plain(config: dict) -> dict:
        return {k: v for k, v in config.items() if not k.startswith("_")}

    modules = {"transformer": Flux2Transformer2DModel(**plain(configs["transformer"])),
               "vae": AutoencoderKLFlux2(**plain(configs["vae"])),
               "text_encoder": Qwen3ForCausalLM(Qwen3Config(**configs["text_encoder"]))}
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_path(target, folder=True) as staging:
            for name, module in modules.items():
                state = {k: v.to(torch.float32) for k, v in load_file(str(weights / f"{name}.safetensors")).items()}
                missing, unexpected = module.load_state_dict(state, strict=False)
                if unexpected or set(missing) - {"lm_head.weight"}:  # Qwen3's lm_head is tied, not shipped
                    raise ValueError(f"The toy Klein's {name} weights do not fit its config "
                                     f"(missing {missing[:3]}, unexpected {unexpected[:3]}).")
                if name == "text_encoder":
                    module.tie_weights()
                module.save_pretrained(staging / name)
            FlowMatchEulerDiscreteScheduler(**plain(configs["scheduler"])).save_pretrained(staging / "scheduler")
            shutil.copytree(weights / "tokenizer", staging / "tokenizer")
            index = json.loads((SHIPPED_CONFIGS["4b"] / "model_index.json").read_text())
            index.update(_diffusers_version=diffusers.__version__, is_distilled=False)
            (staging / "model_index.json").write_text(json.dumps(index, indent=2))
    except OSError:
        if not (target / "model_index.json").is_file():
            raise
        # another process materialised it first; its copy is the same
    return target


@functools.cache
def toy_pipeline_class():
    """Flux2KleinPipeline whose prompts are encoded at the toy's TEXT_LENGTH unless a call says otherwise, so
    every renderer of the toy base (evaluate.render, the demo's prior images, tests) samples at the length it was
    trained with, without being told."""
    from diffusers import Flux2KleinPipeline

    class ToyKleinPipeline(Flux2KleinPipeline):
        def __call__(self, *args, max_sequence_length: int = TEXT_LENGTH, **kwargs):
            return super().__call__(*args, max_sequence_length=max_sequence_length, **kwargs)

    return ToyKleinPipeline


def load_toy_klein_pipeline(model: Path):
    """A Flux2KleinPipeline (the base: classifier-free guidance) over a toy Klein diffusers folder, at the toy's
    text length."""
    pipe = toy_pipeline_class().from_pretrained(str(model), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline_of(parts: dict):
    """A Flux2KleinPipeline over in-memory parts (the build's evaluations)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe = toy_pipeline_class()(scheduler=FlowMatchEulerDiscreteScheduler.from_config(parts["scheduler"].config),
                              vae=parts["vae"], text_encoder=parts["text_encoder"], tokenizer=parts["tokenizer"],
                              transformer=parts["transformer"], is_distilled=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe
