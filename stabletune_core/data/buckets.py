"""Aspect-ratio bucketing: train each image near its own shape, not a square crop.

A bucket is a `(width, height)` pair, both multiples of `step`, whose area is
at most `resolution**2`. Each image goes to the bucket with the closest aspect
ratio, is scaled to cover it and cropped to fit. Batches are drawn from one
bucket at a time so their tensors stack.

Size conventions: buckets are (width, height) like kohya. The SDXL
conditioning values returned by `resize_and_crop` are (height, width) and
(top, left), the order SDXL's `add_time_ids` expects.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch
from PIL import Image


def training_buckets(config: Any) -> list[tuple[int, int]]:
    """The buckets a run with `config` (a TrainConfig) trains in: one square bucket without bucketing."""
    if not config.enable_bucket:
        return [(config.resolution, config.resolution)]
    return make_buckets(config.resolution, config.min_bucket_reso, config.max_bucket_reso, config.bucket_step)


def make_buckets(resolution: int, min_size: int = 256, max_size: int = 1024, step: int = 64) -> list[tuple[int, int]]:
    """All (width, height) buckets for `resolution`, sorted from tallest to widest.

    A `min_size` above `resolution` (the defaults at a tiny test resolution
    such as 64 with step 8) falls back to resolution/2, so portrait and
    landscape buckets still exist; `max_size` is raised to at least
    `resolution` so the square bucket always exists.
    """
    if step <= 0 or resolution <= 0:
        raise ValueError(f"Resolution ({resolution}) and bucket step ({step}) must be positive.")
    if resolution % step:
        raise ValueError(
            f"Resolution {resolution} is not a multiple of the bucket step {step}: pick a multiple of {step}."
        )
    if min_size > resolution:
        min_size = resolution // 2
    min_size = max(step, _round_down(min_size, step))
    max_size = max(resolution, _round_down(max_size, step))
    area = resolution * resolution

    buckets = {(resolution, resolution)}
    for width in range(min_size, max_size + 1, step):
        # The tallest height that keeps the area within budget.
        height = min(max_size, _round_down(area // width, step))
        if height >= min_size:
            buckets.add((width, height))
            buckets.add((height, width))
    return sorted(buckets, key=lambda wh: (wh[0] / wh[1], wh[0]))


def assign_bucket(width: int, height: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is closest to width/height.

    Distance is measured on log aspect ratio so 2:1 and 1:2 are equally far
    from square. Ties go to the larger bucket (less upscaling, more detail).
    """
    if not buckets:
        raise ValueError("No buckets to choose from.")
    target = math.log(width / height)
    return min(buckets, key=lambda wh: (abs(math.log(wh[0] / wh[1]) - target), -wh[0] * wh[1], wh))


def crop_geometry(
    width: int, height: int, bucket: tuple[int, int], *, random_crop: bool, rng: random.Random | None
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Where the crop lands: returns ((scaled_width, scaled_height), (top, left)).

    Split out from `resize_and_crop` so a latent-cached run can compute the
    SDXL crop conditioning without decoding the image again.
    """
    bucket_w, bucket_h = bucket
    scale = max(bucket_w / width, bucket_h / height)
    # ceil (and the max) guard against float rounding leaving us one pixel short.
    scaled_w = max(bucket_w, math.ceil(width * scale - 1e-6))
    scaled_h = max(bucket_h, math.ceil(height * scale - 1e-6))
    spare_x, spare_y = scaled_w - bucket_w, scaled_h - bucket_h
    if random_crop:
        if rng is None:
            raise ValueError("random_crop needs an rng so that crops are reproducible.")
        top, left = rng.randint(0, spare_y), rng.randint(0, spare_x)
    else:
        top, left = spare_y // 2, spare_x // 2
    return (scaled_w, scaled_h), (top, left)


def resize_and_crop(
    image: Image.Image, bucket: tuple[int, int], *, random_crop: bool, rng: random.Random | None = None
) -> tuple[torch.Tensor, tuple[int, int], tuple[int, int]]:
    """Scale `image` to cover `bucket`, crop it to the bucket, return a tensor.

    Returns (pixel_values, crop_top_left, original_size): pixel_values is a
    CHW float32 tensor in [-1, 1] of shape (3, bucket_h, bucket_w);
    crop_top_left is (top, left) in the scaled image; original_size is
    (height, width) of the input image.
    """
    original_size = (image.height, image.width)
    scaled, top_left = crop_geometry(image.width, image.height, bucket, random_crop=random_crop, rng=rng)
    return cut_to_bucket(image, bucket, scaled, top_left), top_left, original_size


def cut_to_bucket(image: Image.Image, bucket: tuple[int, int], scaled_size: tuple[int, int],
                  crop_top_left: tuple[int, int]) -> torch.Tensor:
    """`image` scaled to `scaled_size` and cropped at `crop_top_left` (from `crop_geometry`) to the bucket: a CHW
    float32 tensor in [-1, 1] of shape (3, bucket_h, bucket_w)."""
    (top, left) = crop_top_left
    if tuple(scaled_size) != image.size:
        # LANCZOS keeps fine detail when shrinking large photos, which is the
        # common case; it is also fine for the occasional upscale.
        image = image.resize(tuple(scaled_size), Image.Resampling.LANCZOS)
    image = image.crop((left, top, left + bucket[0], top + bucket[1]))
    array = np.asarray(image.convert("RGB"), dtype=np.float32)
    return (torch.from_numpy(array.copy()).permute(2, 0, 1) / 127.5 - 1.0).contiguous()


def _round_down(value: int, step: int) -> int:
    return (value // step) * step
