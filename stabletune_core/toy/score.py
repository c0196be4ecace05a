"""A deterministic judge of what a toy-world image shows: the colour of its object and its shape.

Generated images are judged, not losses: a LoRA learned the concept when the images of the concept's
prompts show the concept's colour. The object is the set of clearly coloured pixels (the backgrounds are
pale); its colour is the base or concept colour nearest in hue to the object's mean hue; its shape comes
from how much of its bounding box it fills (square ~0.95, circle ~0.79, triangle ~0.5).
"""
from __future__ import annotations

import colorsys
import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np
from PIL import Image

from .world import ALL_COLORS

MIN_SATURATION = 0.35
MIN_VALUE = 0.2
MIN_OBJECT_FRACTION = 0.02  # under 2 % of the image coloured: no object


def _hue_of(rgb: tuple[int, int, int]) -> float:
    return colorsys.rgb_to_hsv(*(c / 255 for c in rgb))[0] * 360


PALETTE_HUES = {name: _hue_of(rgb) for name, rgb in ALL_COLORS.items()}


@dataclass(frozen=True)
class Judgement:
    color: str  # a palette name, or "none" when no object is found
    shape: str  # "circle", "square", "triangle" or "none"
    hue: float
    fill: float
    object_fraction: float


def _hue_distance(a: float, b: float) -> float:
    d = abs(a - b) % 360
    return min(d, 360 - d)


def judge(image: Image.Image) -> Judgement:
    hsv = np.asarray(image.convert("RGB").convert("HSV"), dtype=np.float32) / 255.0
    mask = (hsv[..., 1] > MIN_SATURATION) & (hsv[..., 2] > MIN_VALUE)
    fraction = float(mask.mean())
    if fraction < MIN_OBJECT_FRACTION:
        return Judgement("none", "none", math.nan, 0.0, fraction)
    angles = hsv[..., 0][mask] * 2 * math.pi  # circular mean: red sits at both ends of the hue circle
    hue = math.degrees(math.atan2(float(np.sin(angles).mean()), float(np.cos(angles).mean()))) % 360
    color = min(PALETTE_HUES, key=lambda name: _hue_distance(hue, PALETTE_HUES[name]))
    rows, cols = np.nonzero(mask)
    box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
    fill = float(mask.sum() / box)
    shape = "square" if fill > 0.88 else "circle" if fill > 0.66 else "triangle"
    return Judgement(color, shape, hue, fill, fraction)


def caption_parts(prompt: str) -> tuple[str, str]:
    """("red", "circle") from "a red circle"."""
    words = prompt.split()
    return words[-2], words[-1]


def color_score(images: Iterable[Image.Image], color: str) -> float:
    """Fraction of images whose object has `color`."""
    verdicts = [judge(image).color == color for image in images]
    return sum(verdicts) / max(1, len(verdicts))


def prompt_scores(images_by_prompt: dict[str, list[Image.Image]]) -> dict[str, float]:
    """For each prompt 'a <colour> <shape>', the fraction of its images showing that colour."""
    return {prompt: color_score(images, caption_parts(prompt)[0]) for prompt, images in images_by_prompt.items()}
