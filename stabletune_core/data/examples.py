"""From scanned items to training examples: buckets, crops, flips, captions and loss masks, and their collation.

`DatasetView(scan, config)` sees the scanned items through a TrainConfig's data options. `example(index, epoch)`
builds one training example. Crop, flip and caption randomness each come from their own rng seeded by
(seed, epoch, index), so turning one augmentation on or off does not change the others, and a resumed run
reproduces them exactly. The crop and the flip are decided once per example (`Placement`) and the image and its
loss mask both follow that decision.

With `cache_latents`, augmentation is fixed: center crop, no flip. A cached latent is computed once, so it
cannot follow a per-epoch random crop or flip; the view turns those off and says so in `notes` (setup logs
them).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from .buckets import assign_bucket, crop_geometry, cut_to_bucket, training_buckets
from .captions import process_caption
from .images import load_image
from .masks import load_loss_mask
from .order import Bucket, BucketBatchSampler
from .scan import DataItem, DatasetScan
from .seeds import derive_seed


@dataclass(frozen=True)
class Placement:
    """Where one example's pixels come from in its image: scaled to `scaled_size` (width, height), cropped at
    `crop_top_left` (top, left) to the bucket, then mirrored when `flipped`."""

    scaled_size: tuple[int, int]
    crop_top_left: tuple[int, int]
    flipped: bool


class DatasetView:
    """The scanned items seen through one TrainConfig's data options."""

    def __init__(self, scan: DatasetScan, config: Any) -> None:
        self.scan = scan
        self.items: list[DataItem] = list(scan.items)
        self.resolution = config.resolution
        self.buckets = training_buckets(config)
        self.item_buckets: list[Bucket] = [assign_bucket(i.width, i.height, self.buckets) for i in self.items]
        self.shuffle_caption = config.shuffle_caption
        self.keep_tokens = config.keep_tokens
        self.caption_dropout = config.caption_dropout_rate
        self.tag_dropout = config.caption_tag_dropout_rate
        self.seed = config.seed
        self.cache_latents = config.cache_latents
        self.masked_loss = config.masked_loss  # off: mask files are never opened (a broken one cannot stop the run)
        self.notes: list[str] = list(scan.notes)  # what the scan decided from folder names (0_ folders)
        random_crop, flip_prob = not config.center_crop, 0.5 if config.random_flip else 0.0
        if config.cache_latents and random_crop:
            self.notes.append("Random crop is off because latents are cached: cached latents use a center crop.")
            random_crop = False
        if config.cache_latents and flip_prob > 0:
            self.notes.append(
                "Horizontal flip is off because latents are cached: a cached latent cannot be flipped per epoch."
            )
            flip_prob = 0.0
        self.random_crop = random_crop
        self.flip_prob = flip_prob

    @property
    def fixed_augmentation(self) -> bool:
        """True when every epoch sees the same pixels (center crop, no flip)."""
        return not self.random_crop and self.flip_prob <= 0

    def __len__(self) -> int:
        return len(self.items)

    def entries(self) -> list[tuple[int, Bucket]]:
        """(index, bucket) for every item, repeated `repeats` times (what one epoch holds; for inspection)."""
        return [(i, self.item_buckets[i]) for i, item in enumerate(self.items) for _ in range(item.repeats)]

    def sampler(self, batch_size: int) -> BucketBatchSampler:
        """The batch sampler; repeats are passed as counts, never expanded."""
        entries = [(i, self.item_buckets[i], item.repeats) for i, item in enumerate(self.items)]
        return BucketBatchSampler(entries, batch_size, self.seed)

    def placement(self, index: int, epoch: int) -> Placement:
        """The crop and flip of item `index` in `epoch`, from their own seeded generators."""
        item, bucket = self.items[index], self.item_buckets[index]
        crop_rng = random.Random(derive_seed("crop", self.seed, epoch, index))
        flip_rng = random.Random(derive_seed("flip", self.seed, epoch, index))
        scaled, top_left = crop_geometry(item.width, item.height, bucket, random_crop=self.random_crop, rng=crop_rng)
        return Placement(scaled, top_left, self.flip_prob > 0 and flip_rng.random() < self.flip_prob)

    def example(self, index: int, epoch: int, *, with_pixels: bool = True) -> dict[str, Any]:
        """One training example: pixel_values, caption, path, the SDXL sizes and the loss mask.

        original_size and target_size are (height, width); crop_top_left is (top, left): the order SDXL's time
        ids use. `with_pixels=False` skips decoding the image (the latents come from a LatentCache) but returns
        the same crop coordinates the pixels would have had.
        """
        item, bucket = self.items[index], self.item_buckets[index]
        placement = self.placement(index, epoch)
        out: dict[str, Any] = {}
        if with_pixels:
            pixel_values = cut_to_bucket(load_image(item.path), bucket, placement.scaled_size,
                                         placement.crop_top_left)
            out["pixel_values"] = torch.flip(pixel_values, dims=[-1]) if placement.flipped else pixel_values
        original_size = (item.height, item.width)
        crop_top_left = placement.crop_top_left
        if placement.flipped:  # the crop of the mirrored image starts as far from the left edge as it ended from the right
            crop_top_left = mirrored_crop(crop_top_left, placement.scaled_size, bucket)
        caption_rng = random.Random(derive_seed("caption", self.seed, epoch, index))
        out["caption"] = process_caption(
            item.caption,
            caption_rng,
            shuffle=self.shuffle_caption,
            keep_tokens=self.keep_tokens,
            caption_dropout=self.caption_dropout,
            tag_dropout=self.tag_dropout,
        )
        out["path"] = item.path
        out["is_reg"] = item.is_reg
        out["original_size"] = original_size
        out["crop_top_left"] = crop_top_left
        out["target_size"] = (bucket[1], bucket[0])
        out["flipped"] = placement.flipped
        # None when the image has no mask or masking is off
        out["loss_mask"] = load_loss_mask(item, bucket, placement) if self.masked_loss else None
        return out

    def center_pixel_values(self, index: int) -> torch.Tensor:
        """Center-cropped, unflipped pixels: what a latent cache encodes."""
        item, bucket = self.items[index], self.item_buckets[index]
        scaled, top_left = crop_geometry(item.width, item.height, bucket, random_crop=False, rng=None)
        return cut_to_bucket(load_image(item.path), bucket, scaled, top_left)


def mirrored_crop(crop_top_left: tuple[int, int], scaled_size: tuple[int, int], bucket: Bucket) -> tuple[int, int]:
    """SDXL's crop (top, left) of a horizontally flipped example, as kohya's sd-scripts compute it:
    left becomes scaled width - left - bucket width (the crop seen from the other edge)."""
    top, left = crop_top_left
    return top, scaled_size[0] - left - bucket[0]


def collate(examples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack pixel_values (when present); every other field becomes a list.

    Also adds "sizes": one {"original_size", "crop_top_left", "target_size"}
    dict per example, the shape ModelFamily.make_conditioning takes for SDXL.
    """
    batch: dict[str, Any] = {}
    if "pixel_values" in examples[0]:
        shapes = {tuple(example["pixel_values"].shape) for example in examples}
        if len(shapes) > 1:
            raise ValueError(
                f"A batch mixes image sizes {sorted(shapes)}: "
                "batches must come from one bucket (use BucketBatchSampler)."
            )
        batch["pixel_values"] = torch.stack([example["pixel_values"] for example in examples])
    for key in examples[0]:
        if key != "pixel_values":
            batch[key] = [example[key] for example in examples]
    size_keys = ("original_size", "crop_top_left", "target_size")
    batch["sizes"] = [{key: example[key] for key in size_keys} for example in examples]
    return batch

