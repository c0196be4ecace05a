"""The toy world and the toy base model: a small *pretrained* SD 1.x on which a LoRA's learning is visible.

`toy_base_model()` returns a diffusers folder (in the user cache, built from the fp16 weights shipped in
`weights/`) that every part of StableTune loads like any SD 1.x model. `world.py` draws the images,
`score.py` judges them, `evaluate.py` renders prompts and scores them, `build.py` trains the weights.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..atomic import atomic_path
from ..cache import cache_root

WEIGHTS = Path(__file__).resolve().parent / "weights"
MODEL_INDEX = {
    "_class_name": "StableDiffusionPipeline", "feature_extractor": [None, None], "image_encoder": [None, None],
    "requires_safety_checker": False, "safety_checker": [None, None], "scheduler": ["diffusers", "DDPMScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
    "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
}


def weights_dir() -> Path:
    return WEIGHTS


def toy_base_model(weights: Path = WEIGHTS) -> Path:
    """The shipped toy base as a diffusers folder (built once per weights version, in the cache)."""
    if not (weights / "manifest.json").is_file():
        raise FileNotFoundError(f"The toy base weights are missing from {weights}; rebuild them with "
                                "`python -m stabletune_core.toy build`.")
    return materialize(weights)


def materialize(weights: Path, target: Path | None = None) -> Path:
    """Write a diffusers folder (fp32, with the CLIP tokenizer files) from the fp16 weights in `weights`."""
    import torch
    from safetensors.torch import load_file

    configs_text = (weights / "configs.json").read_bytes()
    # every shipped file: a base whose VAE alone changed (v2's decoder polish) must not reuse the old folder
    digest = hashlib.sha256(configs_text)
    for name in ("unet", "vae", "text_encoder"):
        digest.update((weights / f"{name}.safetensors").read_bytes())
    version = digest.hexdigest()[:12]
    target = target or cache_root() / f"toy-base-{version}"
    if (target / "model_index.json").is_file():
        return target
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from ..models.tokenizer import write_clip_tokenizer_files

    configs = json.loads(configs_text)
    modules = {"unet": UNet2DConditionModel(**configs["unet"]), "vae": AutoencoderKL(**configs["vae"]),
               "text_encoder": CLIPTextModel(CLIPTextConfig(**configs["text_encoder"]))}
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_path(target, folder=True) as staging:
            for name, module in modules.items():
                state = {k: v.to(torch.float32) for k, v in load_file(str(weights / f"{name}.safetensors")).items()}
                module.load_state_dict(state)
                module.save_pretrained(staging / name)
            DDPMScheduler(**{k: v for k, v in configs["scheduler"].items() if not k.startswith("_")}
                          ).save_pretrained(staging / "scheduler")
            write_clip_tokenizer_files(staging / "tokenizer")
            (staging / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=1))
    except OSError:
        if not (target / "model_index.json").is_file():
            raise
        # another process materialised it first; its copy is the same
    return target


def load_toy_pipeline(model: Path):
    """A StableDiffusionPipeline (DDIM, no safety checker) over a toy-base diffusers folder."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(str(model), safety_checker=None, feature_extractor=None,
                                                   requires_safety_checker=False, local_files_only=True)
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe
