"""A deterministic judge of what a toy-world image shows: the hue of its object, in degrees, and its shape.

Generated images are judged, not losses, and with units: the object is the set of clearly coloured pixels
(the backgrounds are pale); its hue is the circular mean of their hues, in degrees; a hue *error* is the
distance on the hue circle to a reference (the concept's training images, or the base model's own image at
the same prompt and seed). The shape comes from two measures of the object's bounding box: how much of it
the object fills (square ~1, circle ~0.79, triangle ~0.5) and how much of its four corner patches it fills
(square ~1, circle ~0.1, triangle: its two bottom corners only), and whether its centre is filled (a ring's
is not). The nearest palette name (`color`) is kept
for humans reading an image; tests and benches assert the degrees.
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
NO_OBJECT_ERROR = 180.0  # an image without an object is as far off as a hue can be
CORE_SATURATION = 0.55  # the object's hue is read on its core: edge pixels blend with the pale background
CORNER_PATCH = 0.2  # a corner patch is this fraction of the bounding box's width and height
CENTRE_PATCH = 0.3  # the centre patch: a ring's hole
#: (fill, corner fill, top corners minus bottom corners, centre fill) of each shape as world.py draws it,
#: measured on the drawn images (tests/test_toy_judge.py); an object is the shape whose prototype is nearest.
SHAPE_PROTOTYPES = {"square": (1.0, 1.0, 0.0, 1.0), "circle": (0.78, 0.11, 0.0, 1.0),
                    "triangle": (0.57, 0.45, -0.9, 1.0), "ring": (0.55, 0.11, 0.0, 0.0)}
#: The shapes nobody taught the toy (world.UNSEEN_SHAPES), measured on drawn images the same way: judged only when a
#: measure asks for one (bench/concept_suite.py), beside SHAPE_PROTOTYPES, so every other judgement stays as it was.
UNSEEN_SHAPE_PROTOTYPES = {"cross": (0.5, 0.0, 0.0, 1.0), "wedge": (0.57, 0.45, 0.9, 1.0)}


def hue_of(rgb: tuple[int, int, int]) -> float:
    """Hue of an RGB colour in degrees, 0-360."""
    return colorsys.rgb_to_hsv(*(c / 255 for c in rgb))[0] * 360


PALETTE_HUES = {name: hue_of(rgb) for name, rgb in ALL_COLORS.items()}


def hue_distance(a: float, b: float) -> float:
    """Degrees between two hues on the hue circle (0-180); 180 when either is NaN (no object)."""
    if math.isnan(a) or math.isnan(b):
        return NO_OBJECT_ERROR
    d = abs(a - b) % 360
    return min(d, 360 - d)


def circular_mean(hues: Iterable[float]) -> float:
    """The mean of hues in degrees on the circle (red sits at both ends); NaN when there is none."""
    radians = [math.radians(h) for h in hues if not math.isnan(h)]
    if not radians:
        return math.nan
    return math.degrees(math.atan2(sum(map(math.sin, radians)), sum(map(math.cos, radians)))) % 360


@dataclass(frozen=True)
class Judgement:
    color: str  # the nearest palette name (for humans), or "none" when no object is found
    shape: str  # "circle", "square", "triangle" or "none"
    hue: float  # degrees, NaN when no object is found
    fill: float  # object pixels / bounding box
    corners: float  # mean fill of the bounding box's four corner patches
    top_minus_bottom: float  # top corner patches' fill minus the bottom ones' (a triangle's apex is up)
    centre: float  # fill of the bounding box's centre patch (a ring's is empty)
    object_fraction: float


def _shape_measures(mask: np.ndarray) -> tuple[float, float, float, float]:
    rows, cols = np.nonzero(mask)
    # the bounding box of the bulk of the object: a few stray coloured pixels must not stretch it
    top, bottom = np.percentile(rows, [0.5, 99.5]).round().astype(int)
    left, right = np.percentile(cols, [0.5, 99.5]).round().astype(int)
    box = mask[top:bottom + 1, left:right + 1].astype(np.float32)
    height, width = box.shape
    fill = float(box.mean())
    ph, pw = max(1, round(height * CORNER_PATCH)), max(1, round(width * CORNER_PATCH))
    patches = [box[:ph, :pw].mean(), box[:ph, -pw:].mean(), box[-ph:, :pw].mean(), box[-ph:, -pw:].mean()]
    corners = float(np.mean(patches))
    top_minus_bottom = float((patches[0] + patches[1] - patches[2] - patches[3]) / 2)
    ch, cw = max(1, round(height * CENTRE_PATCH)), max(1, round(width * CENTRE_PATCH))
    y0, x0 = (height - ch) // 2, (width - cw) // 2
    centre = float(box[y0:y0 + ch, x0:x0 + cw].mean())
    return fill, corners, top_minus_bottom, centre


def shape_of(fill: float, corners: float, top_minus_bottom: float, centre: float,
             prototypes: dict[str, tuple[float, ...]] = SHAPE_PROTOTYPES) -> str:
    """The shape whose (fill, corners, top - bottom, centre) prototype is nearest."""
    point = (fill, corners, top_minus_bottom, centre)
    return min(prototypes, key=lambda s: sum((a - b) ** 2 for a, b in zip(point, prototypes[s])))


def judge(image: Image.Image, prototypes: dict[str, tuple[float, ...]] = SHAPE_PROTOTYPES) -> Judgement:
    """Hue and shape of an image's object; `prototypes`: the shapes it may be (default: the toy world's four)."""
    hsv = np.asarray(image.convert("RGB").convert("HSV"), dtype=np.float32) / 255.0
    mask = (hsv[..., 1] > MIN_SATURATION) & (hsv[..., 2] > MIN_VALUE)
    fraction = float(mask.mean())
    if fraction < MIN_OBJECT_FRACTION:
        return Judgement("none", "none", math.nan, 0.0, 0.0, 0.0, 0.0, fraction)
    core = mask & (hsv[..., 1] > CORE_SATURATION)
    core = core if core.sum() >= 0.25 * mask.sum() else mask
    angles = hsv[..., 0][core] * 2 * math.pi  # circular mean: red sits at both ends of the hue circle
    hue = math.degrees(math.atan2(float(np.sin(angles).mean()), float(np.cos(angles).mean()))) % 360
    color = min(PALETTE_HUES, key=lambda name: hue_distance(hue, PALETTE_HUES[name]))
    measures = _shape_measures(mask)
    return Judgement(color, shape_of(*measures, prototypes), hue, *measures, fraction)


def caption_parts(prompt: str) -> tuple[str, str]:
    """("red", "circle") from "a red circle"."""
    words = prompt.split()
    return words[-2], words[-1]


def reference_hue(images: Iterable[Image.Image]) -> float:
    """The hue a set of images shows (e.g. a concept's training images), as the circular mean of their hues."""
    return circular_mean(judge(image).hue for image in images)
