"""Render prompts with fixed seeds and score what the images show."""
from __future__ import annotations

from typing import Any

import torch

from .score import caption_parts, judge
from .world import base_prompts, concept_prompts

#: How the toy base is judged everywhere (build, tests, demo summary): same sampler, steps and guidance.
INFERENCE_STEPS = 20
GUIDANCE = 5.0


@torch.no_grad()
def render(pipe: Any, prompts: list[str], seeds: list[int], *, steps: int = INFERENCE_STEPS,
           guidance: float = GUIDANCE, size: int = 64, **kwargs: Any) -> dict[str, list]:
    """{prompt: [image per seed]}; each (prompt, seed) image is the same whatever else is rendered."""
    out = {}
    for prompt in prompts:
        images = []
        for seed in seeds:
            generator = torch.Generator("cpu").manual_seed(seed)
            images += pipe(prompt, height=size, width=size, num_inference_steps=steps, guidance_scale=guidance,
                           generator=generator, **kwargs).images
        out[prompt] = images
    return out


def scores(images_by_prompt: dict[str, list]) -> dict[str, dict[str, float]]:
    """Per prompt: the fraction of its images with the prompt's colour and with its shape."""
    result = {}
    for prompt, images in images_by_prompt.items():
        color, shape = caption_parts(prompt)
        verdicts = [judge(image) for image in images]
        result[prompt] = {"color": sum(v.color == color for v in verdicts) / len(verdicts),
                          "shape": sum(v.shape == shape for v in verdicts) / len(verdicts)}
    return result


def mean(values) -> float:
    values = list(values)
    return sum(values) / max(1, len(values))


def concept_score(pipe: Any, seeds: list[int], **kwargs: Any) -> float:
    """Fraction of the concept prompts' images that show the concept colour."""
    per_prompt = scores(render(pipe, concept_prompts(), seeds, **kwargs))
    return mean(p["color"] for p in per_prompt.values())


def base_report(pipe: Any, *, seeds_per_prompt: int = 4, first_seed: int = 1000, **kwargs: Any) -> dict:
    """The base vocabulary's colour and shape scores, and the concept's (low for a base that never saw it)."""
    seeds = list(range(first_seed, first_seed + seeds_per_prompt))
    base = scores(render(pipe, base_prompts(), seeds, **kwargs))
    return {"base_color_score": round(mean(p["color"] for p in base.values()), 4),
            "base_shape_score": round(mean(p["shape"] for p in base.values()), 4),
            "concept_score": round(concept_score(pipe, seeds, **kwargs), 4),
            "per_prompt": {k: v["color"] for k, v in base.items()}}
