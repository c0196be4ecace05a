"""Validation images: the same prompts and seeds every time, so steps can be compared side by side."""
from __future__ import annotations

import contextlib
import gc
import json
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..config import TrainConfig
from ..models.base import ModelBundle
from ..runs.layout import sample_image_name, sample_prompts
from .placement import on_device

def sample_seeds(config: TrainConfig, *, final: bool = False) -> list[int]:
    """The fixed seeds of a sampling: config.seed on, num_validation_images of them; at the run's last sampling
    (`final`) final_validation_images of them when that is more, so the learning summary reads more images per
    prompt (issue 35.3). The first seeds are the same at every sampling, so steps still compare side by side."""
    count = max(config.num_validation_images, config.final_validation_images) if final \
        else config.num_validation_images
    return [config.seed + i for i in range(count)]


def image_count(config: TrainConfig) -> int:
    """How many images one sampling makes: every validation prompt with every fixed seed."""
    return len(config.validation_prompts) * config.num_validation_images


@torch.no_grad()
def make_validation_images(bundle: ModelBundle, config: TrainConfig, folder: Path, device: torch.device,
                           *, resolution: int | None = None,
                           autocast: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
                           only: Sequence[int] | None = None, should_stop: Callable[[], bool] | None = None,
                           seeds: Sequence[int] | None = None) -> list[Path]:
    """Render every validation prompt with every fixed seed into `folder` (runs/layout.py sample_image_name).

    `only`: the images to make now, by their place in that prompt x seed order (the loop makes a deferred
    sampling a few images at a time between steps); `should_stop`: asked before each prompt's images after the
    first (a prompt's seeds are drawn in one call), so a stop asked for while sampling ends it at the next prompt
    (issue 25.4); `seeds`: the seeds of this sampling (default sample_seeds: the final sampling has more), which
    prompts.json lists. Returns the images made.

    The pipeline stops at the latents and the family decodes them (in the VAE's own dtype: under fp16 the UNet and
    text encoders run in fp16 while the VAE stays fp32, so the pipeline's own decode would feed fp16 latents to
    fp32 weights), so fp16, bf16 and fp32 all work.
    `autocast` is the training's mixed precision (train/amp.py): the pipeline's denoising runs in it, as the
    training forward does; the decode stays outside, in the VAE's own dtype (an fp16 VAE decode overflows).
    """
    prompts = config.validation_prompts
    if not prompts:
        return []
    scheduler, extra = bundle.family.validation_sampler(bundle, config)
    pipe = bundle.family.make_pipeline(bundle, scheduler)
    pipe.set_progress_bar_config(disable=True)
    size = resolution or config.resolution
    training = [m.training for m in (bundle.denoiser, *bundle.text_encoders)]
    for module in (bundle.denoiser, *bundle.text_encoders):
        module.eval()  # LoRA dropout off while sampling
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with on_device((bundle.vae, *bundle.text_encoders), device):  # they may wait on the CPU (placement.py)
            paths = _render(pipe, bundle, prompts, config, folder, size, extra, autocast, only, should_stop,
                            list(seeds) if seeds is not None else sample_seeds(config))
    finally:
        for module, was_training in zip((bundle.denoiser, *bundle.text_encoders), training):
            module.train(was_training)
        del pipe
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # sampling must not leave VRAM behind for the next training step
    return paths


def _render(pipe, bundle: ModelBundle, prompts: list[str], config: TrainConfig, folder: Path, size: int,
            extra: dict, autocast: Callable[[], AbstractContextManager[Any]], only: Sequence[int] | None,
            should_stop: Callable[[], bool] | None, seeds: list[int]) -> list[Path]:
    """A prompt's asked seeds are drawn in one pipeline call, each image from its own seeded generator: an image
    depends on its prompt and seed only (up to one 8-bit level from the batch's summation order, as the toy judge's
    render), and on a dispatch-bound model 4 seeds cost about what 1.4 drawn one by one do."""
    paths: list[Path] = []
    jobs = [(p, prompt, seed) for p, prompt in enumerate(prompts) for seed in seeds]
    for p, prompt, group in _by_prompt(jobs if only is None else [jobs[i] for i in only]):
        if paths and should_stop is not None and should_stop():
            break
        generators = [torch.Generator("cpu").manual_seed(seed) for seed in group]
        with autocast():
            latents = pipe(prompt=prompt, height=size, width=size, num_images_per_prompt=len(group),
                           num_inference_steps=config.validation_inference_steps,
                           guidance_scale=config.validation_guidance_scale,
                           generator=generators if len(generators) > 1 else generators[0],
                           output_type="latent", **extra).images
        pixels = bundle.family.decode_sampled(bundle, latents)
        for seed, image in zip(group, pipe.image_processor.postprocess(pixels.float(), output_type="pil")):
            path = folder / sample_image_name(p, seed)
            image.save(path)
            paths.append(path)
    sample_prompts(folder).write_text(json.dumps({"prompts": prompts, "seeds": seeds}))
    return paths


def _by_prompt(jobs: list[tuple[int, str, int]]) -> list[tuple[int, str, list[int]]]:
    """Consecutive jobs of one prompt as (prompt index, prompt, [seeds]), in the jobs' order."""
    groups: list[tuple[int, str, list[int]]] = []
    for p, prompt, seed in jobs:
        if groups and groups[-1][0] == p:
            groups[-1][2].append(seed)
        else:
            groups.append((p, prompt, [seed]))
    return groups
