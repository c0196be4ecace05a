"""The toy codec's hue floor: how far a VAE encode-decode round trip turns a drawn shape's hue, around the whole circle.

No LoRA on the denoiser can draw a colour closer than the codec draws it back (issue 35.1), so the toy bases' codecs
must carry every hue, not only the toy world's palette. `hue_circle_floor` measures it on the toy world's own images
(its shapes, sizes and pale backgrounds) in one colour per hue step; `round_trip` wraps an SD-style VAE (encode to the
posterior's mode, decode) as a PIL-to-PIL function; `hue_circle_batch` and `palette_batch` draw the images a codec
that carries every hue trains on (bench/codec_trials.py).
"""
from __future__ import annotations

import colorsys
import random
from typing import Any, Callable

from .world import ALL_COLORS, ALL_SHAPES, SHAPES, Scene, draw_scene

HUE_STEP = 10  # degrees between measured hues
IMAGES_PER_HUE = 12  # as a concept's training set: every base shape, four drawings each
SUITE_SATURATION, SUITE_VALUE = 0.8, 0.85  # the concept suite's colours (bench/concept_suite.py)
#: Drawing seeds of the measured images: far from the build's training draws (random seeds below 2**31 are drawn
#: there too, so this only keeps the measure's images fixed, not unseen: the codec may see every hue).
MEASURE_SEED = 9_000_000
MEAN_COLOUR_WEIGHT = 4.0  # the term on the object's mean colour (build.polish_decoder's)


def rgb_of_hue(hue: float, saturation: float = SUITE_SATURATION, value: float = SUITE_VALUE) -> tuple[int, int, int]:
    """A colour of hue `hue` (degrees) as 0-255 RGB."""
    r, g, b = colorsys.hsv_to_rgb((hue % 360) / 360, saturation, value)
    return round(r * 255), round(g * 255), round(b * 255)


def hue_scenes(hue: float, count: int = IMAGES_PER_HUE) -> list[Scene]:
    """`count` drawings of one hue in every base shape (fixed seeds: a measure, not a sample)."""
    return [Scene(f"hue{hue:g}", SHAPES[i % len(SHAPES)], MEASURE_SEED + int(hue) * 100 + i, rgb=rgb_of_hue(hue))
            for i in range(count)]


def hue_shift(image, round_tripped) -> float:
    """Degrees between the object's hue in an image and in its round trip (the judge's hue measure)."""
    from .score import hue_distance, judge

    return hue_distance(judge(round_tripped).hue, judge(image).hue)


def hue_circle_floor(round_trip: Callable[[Any], Any], step: int = HUE_STEP) -> dict[int, float]:
    """hue (degrees, every `step`) -> the mean hue shift of its drawn images through `round_trip`."""
    floor = {}
    for hue in range(0, 360, step):
        images = [draw_scene(scene) for scene in hue_scenes(hue)]
        floor[hue] = sum(hue_shift(image, round_trip(image)) for image in images) / len(images)
    return floor


def shape_keeping(round_trip: Callable[[Any], Any], count: int = 16) -> dict[str, float]:
    """'colour shape' (every base colour and shape) -> the share of its `count` drawings whose judged shape survives
    `round_trip`. A codec that rounds a square's corners off (a hue-circle codec trained on the mean colour alone
    gave back 1 green square in 16 as a square) caps every denoiser on it: what it cannot give back, none draws."""
    from .score import judge
    from .world import BASE_COLORS

    kept = {}
    for color in BASE_COLORS:
        for shape in SHAPES:
            scenes = [Scene(color, shape, MEASURE_SEED + 50_000 + i) for i in range(count)]
            kept[f"{color} {shape}"] = sum(judge(round_trip(draw_scene(s))).shape == shape for s in scenes) / count
    return kept


def round_trip(vae) -> Callable[[Any], Any]:
    """PIL image -> the same image encoded (the posterior's mode) and decoded by `vae` (an SD-style AutoencoderKL)."""
    import numpy as np
    import torch
    from PIL import Image

    @torch.no_grad()
    def through(image):
        pixels = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 127.5 - 1)
        latents = vae.encode(pixels.permute(2, 0, 1)[None]).latent_dist.mode()
        decoded = vae.decode(latents).sample[0].clamp(-1, 1).permute(1, 2, 0)
        return Image.fromarray(((decoded.numpy() + 1) * 127.5).round().astype("uint8"))

    return through


def hue_circle_batch(rng: random.Random, size: int) -> list:
    """Images for the codec's decoder stage: a quarter in the toy world's named colours (so the palette the denoiser
    draws stays exact), the rest of any hue, uniform around the circle, at the saturations and brightnesses a
    user's colour may have, in every shape the codec knows."""
    images = []
    for _ in range(size):
        shape = rng.choice(ALL_SHAPES)
        if rng.random() < 0.25:
            images.append(draw_scene(Scene(rng.choice(list(ALL_COLORS)), shape, rng.randrange(2**31))))
            continue
        rgb = rgb_of_hue(rng.uniform(0, 360), rng.uniform(0.55, 1.0), rng.uniform(0.5, 0.95))
        images.append(draw_scene(Scene("any", shape, rng.randrange(2**31), rgb=rgb)))
    return images


def palette_batch(rng: random.Random, size: int) -> list:
    """The toy world's named colours (the concept's purple included) in every shape the codec knows: the images
    whose latents the denoiser learned (and the demos' LoRAs learn), which the hue-circle stage keeps in place."""
    return [draw_scene(Scene(rng.choice(list(ALL_COLORS)), rng.choice(ALL_SHAPES), rng.randrange(2**31)))
            for _ in range(size)]


def mean_colour_error(error, saturated):
    """Per image and channel, the reconstruction error of the object's mean colour (`saturated`: its pixels)."""
    return (error * saturated).sum((2, 3)) / saturated.sum((2, 3)).clamp(min=1)


def edge_band(saturated):
    """The pixels within 2 of the object's outline (its mask dilated minus eroded, 5x5): where a corner is kept or
    rounded off, which the judge's shape reads and the per-pixel terms, spread over the whole object, barely see."""
    import torch.nn.functional as F

    return F.max_pool2d(saturated, 5, 1, 2) + F.max_pool2d(-saturated, 5, 1, 2)


def reconstruction_loss(x, error, mean_colour_weight: float = 0.0, edge_weight: float = 0.0):
    """The toy codecs' loss on a batch `x` (pixels in -1..1) reconstructed with `error`: L1 and L2 with the object's
    pixels weighed up (the object is a fifth of the image: unweighted, the codec learns backgrounds and greys the
    colours), plus `mean_colour_weight` times the error of the object's mean colour (a small error on every object
    pixel, which the per-pixel terms barely see, is a hue shift the judge and the user see), with the object's
    outline (edge_band) weighed up by a further `edge_weight`."""
    saturated = ((x.amax(1, keepdim=True) - x.amin(1, keepdim=True)) > 0.5).float()
    weight = 1 + 8 * saturated
    if edge_weight:
        weight = weight + edge_weight * edge_band(saturated)
    loss = (weight * error.abs()).mean() + (weight * error.pow(2)).mean()
    if mean_colour_weight:
        loss = loss + mean_colour_weight * mean_colour_error(error, saturated).abs().mean()
    return loss
