"""Masked loss: an optional mask image per training image (white = train, black = ignore).

Where a mask lives, for an image `folder/NAME.EXT`:
  folder/NAME.mask.png      beside the image, or
  folder/masks/NAME.png     in a `masks` folder beside it.
The scan skips both (they are not training images). A mask is resized to its image's size if it was drawn
at another one, then scaled, cropped and flipped exactly as the image is (the same seeds), so it stays on
the pixels it was drawn on. The loop area-averages it to latent size and weights the per-element loss with
it; images without a mask weigh 1 everywhere, as without this feature.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

from .filenames import is_file, name_too_long

MASK_SUFFIX = ".mask.png"
MASK_FOLDER = "masks"


def is_mask_file(path: Path) -> bool:
    """A mask image, not a training image (the scan skips these)."""
    return path.name.lower().endswith(MASK_SUFFIX)


@functools.lru_cache(maxsize=None)
def mask_path(image: Path) -> Path | None:
    """The mask of an image, looked up once per process (a file system lookup per example costs more than
    the rest of the example on a slow disk); like the scan, masks added during a run count from the next."""
    for candidate in (mask_beside(image), image.parent / MASK_FOLDER / f"{image.stem}.png"):
        if is_file(candidate):  # NAME.mask.png of an image named near the limit is too long to exist
            return candidate
    return None


def mask_beside(image: Path) -> Path:
    """Where the mask of `image` lives beside it (NAME.mask.png)."""
    return image.with_name(image.stem + MASK_SUFFIX)


def mask_name_too_long(image: Path) -> bool:
    """Whether `image`'s name is so long that NAME.mask.png cannot exist beside it (its mask must go in masks/)."""
    return name_too_long(mask_beside(image))


def mask_problem(image: Path) -> str | None:
    """Why an image cannot train with its mask (None: no mask, or a usable one). The mask is decoded fully during
    the scan, like the image: a mask that cannot be read, or one that is all black (the loss and every gradient
    of the image would be 0), skips the image instead of stopping or silently not training the run."""
    from .images import UnreadableImageError, load_image

    path = mask_path(image)
    if path is None:
        return None
    try:
        with load_image(path) as mask:
            darkest_is_all = mask.convert("L").getextrema()[1] == 0
    except UnreadableImageError as exc:
        return f"its mask {path.name} cannot be read ({exc.reason}); fix or remove the mask"
    if darkest_is_all:
        return (f"its mask {path.name} is all black, so nothing of the image would train; paint the part to train "
                "white, or remove the mask")
    return None


def load_loss_mask(item: Any, bucket: tuple[int, int], placement: Any) -> torch.Tensor | None:
    """The (1, H, W) mask in [0, 1] of one example, scaled, cropped and flipped as its pixels are (the example's
    `Placement`, decided once for both); None without a mask."""
    path = mask_path(item.path)  # a Path already (DataItem)
    if path is None:
        return None
    with Image.open(path) as raw:
        mask = ImageOps.exif_transpose(raw).convert("L")
    if mask.size != (item.width, item.height):
        mask = mask.resize((item.width, item.height), Image.Resampling.BILINEAR)
    if tuple(placement.scaled_size) != mask.size:
        mask = mask.resize(tuple(placement.scaled_size), Image.Resampling.BILINEAR)  # no ringing below 0 or above 1
    top, left = placement.crop_top_left
    mask = mask.crop((left, top, left + bucket[0], top + bucket[1]))
    tensor = torch.from_numpy(np.asarray(mask, dtype=np.float32).copy())[None] / 255.0
    if placement.flipped:
        tensor = torch.flip(tensor, dims=[-1])
    return tensor


def batch_loss_mask(batch: dict[str, Any], latent_size: tuple[int, int]) -> torch.Tensor | None:
    """(B, 1, h, w) masks at latent size for a collated batch, ones for images without a mask; None when no
    image of the batch has one (then the loss is computed exactly as without masks)."""
    masks = batch.get("loss_mask")
    if not masks or all(m is None for m in masks):
        return None
    height, width = batch["target_size"][0]
    full = torch.stack([m if m is not None else torch.ones(1, height, width) for m in masks])
    return torch.nn.functional.interpolate(full, size=tuple(latent_size), mode="area")


#: A crop whose mask is nowhere above this trains (almost) nothing: bilinear resizing leaks a few levels of a white
#: area just outside the crop into its edge, which must not count as "trained".
KEEPS_NOTHING = 1 / 255


def masks_outside_crop(view: Any) -> list[Any]:
    """The items of a `DatasetView` whose mask is white only outside the part of the image that trains, so that the
    image trains nothing: with a fixed (centre) crop, the crop of every epoch; with a random crop the crop can land
    anywhere, so none is listed (an all-black mask is the scan's job, mask_problem)."""
    if not view.masked_loss or view.random_crop:
        return []
    outside = []
    for index, item in enumerate(view.items):
        mask = load_loss_mask(item, view.item_buckets[index], view.placement(index, 0))
        if mask is not None and float(mask.max()) <= KEEPS_NOTHING:
            outside.append(item)
    return outside


def masks_note(items: list[Any]) -> str | None:
    """How many training images have a mask (for events.jsonl); None when none has."""
    found = sum(mask_path(item.path) is not None for item in items)
    if not found:
        return None
    return f"{found} of {len(items)} images have a loss mask (white = trained, black = ignored)."
