"""From a scanned folder to training batches: bucketed sampling, examples, caches.

Everything random here is a pure function of (seed, epoch, index), never of
how many batches came before. That is what makes resume exact: a run that
restarts at epoch E, batch K regenerates epoch E's batch order, skips K
batches, and sees the same crops, flips and captions it would have seen.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import os
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..atomic import atomic_path
from .buckets import assign_bucket, crop_geometry, make_buckets, resize_and_crop
from .captions import process_caption
from .images import load_image
from .masks import load_loss_mask
from .scan import DataItem, DatasetScan

Bucket = tuple[int, int]


def derive_seed(*parts: object) -> int:
    """A stable 64-bit seed from any tuple of simple values.

    Python's hash() of strings changes between processes, so a resumed run
    would draw different numbers; sha256 does not.
    """
    digest = hashlib.sha256(repr(parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little")


class BucketBatchSampler:
    """Batches in which every index shares one bucket, in a per-epoch order.

    `entries` are (item index, bucket) or (item index, bucket, repeats): an item with repeats 5 appears 5 times
    per epoch. Repeats are never expanded into a list: the order of epoch E is a keyed pseudo-random permutation
    (seeded by (seed, E)) computed one batch at a time, so memory and set-up time do not grow with the repeat
    counts and `batches_for_epoch(E)[K]` is batch K of epoch E without building the others (resume mid-epoch).

    The last, incomplete batch of each bucket is kept as a smaller batch.
    Dropping it (drop_last) would silently never train images that land in a
    bucket holding fewer than `batch_size` of them, which is common with
    bucketing; a slightly smaller batch now and then is the cheaper price.
    """

    def __init__(self, entries: Sequence[tuple], batch_size: int, seed: int) -> None:
        if batch_size < 1:
            raise ValueError(f"Batch size must be at least 1, got {batch_size}.")
        if not entries:
            raise ValueError("Cannot make batches from an empty dataset.")
        groups: dict[Bucket, tuple[list[int], list[int]]] = {}  # bucket -> (indices, running total of repeats)
        for index, bucket, *repeats in entries:
            count = repeats[0] if repeats else 1
            if count < 1:
                continue
            indices, totals = groups.setdefault(tuple(bucket), ([], []))
            indices.append(index)
            totals.append((totals[-1] if totals else 0) + count)
        if not groups:
            raise ValueError("Cannot make batches from an empty dataset.")
        self._groups = list(dict(sorted(groups.items())).values())  # fixed order before any shuffling
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.skip_batches = 0
        batch_totals, total = [], 0
        for _, totals in self._groups:
            total += math.ceil(totals[-1] / batch_size)
            batch_totals.append(total)
        self._batch_totals = batch_totals  # running total of batches over the buckets

    def __len__(self) -> int:
        return self._batch_totals[-1]

    def batches_for_epoch(self, epoch: int) -> "EpochOrder":
        """The batches of `epoch`, in order, as a lazy sequence (len, indexing, slicing, iteration)."""
        return EpochOrder(self, epoch)

    def batch(self, epoch: int, k: int) -> list[int]:
        """Batch `k` of `epoch`: item indices, all in one bucket."""
        key = derive_seed("batches", self.seed, epoch)
        slot = _permute(k, len(self), key)  # shuffle across buckets too, so portraits and landscapes mix
        group = bisect.bisect_right(self._batch_totals, slot)
        first_batch = self._batch_totals[group - 1] if group else 0
        indices, totals = self._groups[group]
        size, bucket_key = totals[-1], derive_seed("bucket", self.seed, epoch, group)
        start = (slot - first_batch) * self.batch_size
        positions = (_permute(p, size, bucket_key) for p in range(start, min(start + self.batch_size, size)))
        return [indices[bisect.bisect_right(totals, p)] for p in positions]

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Choose what `__iter__` yields (for use as a DataLoader batch_sampler)."""
        self.epoch = epoch
        self.skip_batches = skip_batches

    def __iter__(self) -> Iterator[list[int]]:
        order = self.batches_for_epoch(self.epoch)
        for k in range(self.skip_batches, len(order)):
            yield order[k]


class EpochOrder(Sequence):
    """The batches of one epoch, computed when asked for (see BucketBatchSampler)."""

    def __init__(self, sampler: BucketBatchSampler, epoch: int) -> None:
        self.sampler, self.epoch = sampler, epoch

    def __len__(self) -> int:
        return len(self.sampler)

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        if not -len(self) <= k < len(self):
            raise IndexError(k)
        return self.sampler.batch(self.epoch, k % len(self))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)


def _permute(i: int, n: int, key: int) -> int:
    """Position `i` of a keyed pseudo-random permutation of range(n), in O(1) memory: a 4-round Feistel network
    on the smallest even-bit domain holding n, walking the cycle until the result falls inside range(n)."""
    if n <= 1:
        return 0
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    x = i
    while True:
        left, right = x >> half, x & mask
        for round_ in range(4):
            left, right = right, left ^ (_mix(key + round_ * 0x9E3779B97F4A7C15 + right) & mask)
        x = (left << half) | right
        if x < n:
            return x


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit hash of an integer."""
    x &= 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class DatasetView:
    """The scanned items seen through one set of training options.

    `example(index, epoch)` builds one training example. Crop, flip and
    caption randomness each come from their own rng seeded by
    (seed, epoch, index), so turning one augmentation on or off does not
    change the others, and a resumed run reproduces them exactly.

    With `cache_latents`, augmentation is fixed: center crop, no flip. A
    cached latent is computed once, so it cannot follow a per-epoch random
    crop or flip; the view turns those off and says so in `notes` (the loop
    should log them).
    """

    def __init__(
        self,
        scan: DatasetScan,
        resolution: int,
        *,
        enable_bucket: bool = True,
        bucket_step: int = 64,
        min_bucket_size: int = 256,
        max_bucket_size: int = 1024,
        random_crop: bool = False,
        flip_prob: float = 0.0,
        shuffle_caption: bool = False,
        keep_tokens: int = 0,
        caption_dropout: float = 0.0,
        tag_dropout: float = 0.0,
        seed: int = 0,
        cache_latents: bool = False,
        masked_loss: bool = True,
    ) -> None:
        self.scan = scan
        self.items: list[DataItem] = list(scan.items)
        self.resolution = resolution
        if enable_bucket:
            self.buckets = make_buckets(resolution, min_bucket_size, max_bucket_size, bucket_step)
        else:
            self.buckets = [(resolution, resolution)]
        self.item_buckets: list[Bucket] = [assign_bucket(i.width, i.height, self.buckets) for i in self.items]
        self.shuffle_caption = shuffle_caption
        self.keep_tokens = keep_tokens
        self.caption_dropout = caption_dropout
        self.tag_dropout = tag_dropout
        self.seed = seed
        self.cache_latents = cache_latents
        self.masked_loss = masked_loss  # off: mask files are never opened (a broken one cannot stop the run)
        self.notes: list[str] = list(scan.notes)  # what the scan decided from folder names (0_ folders)
        if cache_latents and random_crop:
            self.notes.append("Random crop is off because latents are cached: cached latents use a center crop.")
            random_crop = False
        if cache_latents and flip_prob > 0:
            self.notes.append(
                "Horizontal flip is off because latents are cached: a cached latent cannot be flipped per epoch."
            )
            flip_prob = 0.0
        self.random_crop = random_crop
        self.flip_prob = flip_prob

    @classmethod
    def from_config(cls, scan: DatasetScan, config: Any) -> DatasetView:
        """Build the view from a TrainConfig (read by attribute name, kohya/diffusers spelling)."""
        return cls(
            scan,
            config.resolution,
            enable_bucket=config.enable_bucket,
            bucket_step=config.bucket_step,
            min_bucket_size=config.min_bucket_reso,
            max_bucket_size=config.max_bucket_reso,
            random_crop=not config.center_crop,
            flip_prob=0.5 if config.random_flip else 0.0,
            shuffle_caption=config.shuffle_caption,
            keep_tokens=config.keep_tokens,
            caption_dropout=config.caption_dropout_rate,
            tag_dropout=config.caption_tag_dropout_rate,
            seed=config.seed,
            cache_latents=config.cache_latents,
            masked_loss=config.masked_loss,
        )

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

    def example(self, index: int, epoch: int, *, with_pixels: bool = True) -> dict[str, Any]:
        """One training example: pixel_values, caption, path and the SDXL sizes.

        original_size and target_size are (height, width); crop_top_left is
        (top, left): the order SDXL's time ids use. `with_pixels=False` skips
        decoding the image (the latents come from a LatentCache) but returns
        the same crop coordinates the pixels would have had.
        """
        item, bucket = self.items[index], self.item_buckets[index]
        crop_rng = random.Random(derive_seed("crop", self.seed, epoch, index))
        flip_rng = random.Random(derive_seed("flip", self.seed, epoch, index))
        flipped = self.flip_prob > 0 and flip_rng.random() < self.flip_prob
        out: dict[str, Any] = {}
        if with_pixels:
            pixel_values, crop_top_left, original_size = resize_and_crop(
                load_image(item.path), bucket, random_crop=self.random_crop, rng=crop_rng
            )
            out["pixel_values"] = torch.flip(pixel_values, dims=[-1]) if flipped else pixel_values
        else:
            _, crop_top_left = crop_geometry(
                item.width, item.height, bucket, random_crop=self.random_crop, rng=crop_rng
            )
            original_size = (item.height, item.width)
        if flipped:  # the crop of the mirrored image starts as far from the left edge as it ended from the right
            crop_top_left = mirrored_crop(crop_top_left, original_size, bucket)
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
        # None when the image has no mask or masking is off
        out["loss_mask"] = load_loss_mask(item, bucket, self, epoch, index) if self.masked_loss else None
        return out

    def center_pixel_values(self, index: int) -> torch.Tensor:
        """Center-cropped, unflipped pixels: what a latent cache encodes."""
        pixel_values, _, _ = resize_and_crop(
            load_image(self.items[index].path), self.item_buckets[index], random_crop=False
        )
        return pixel_values


def mirrored_crop(crop_top_left: tuple[int, int], original_size: tuple[int, int], bucket: Bucket) -> tuple[int, int]:
    """SDXL's crop (top, left) of a horizontally flipped example, as kohya's sd-scripts compute it:
    left becomes scaled width - left - bucket width (the crop seen from the other edge)."""
    (scaled_w, _), _ = crop_geometry(original_size[1], original_size[0], bucket, random_crop=False, rng=None)
    top, left = crop_top_left
    return top, scaled_w - left - bucket[0]


def collate(examples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack pixel_values (when present); every other field becomes a list.

    Also adds "sizes": one {"original_size", "crop_top_left", "target_size"}
    dict per example, the shape ModelFamily.encode_prompts takes for SDXL.
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


# --------------------------------------------------------------------------- the data loader

Position = tuple[int, int]  # (epoch, sampler batches of that epoch already consumed)


class ShardedBatchSampler:
    """A DataLoader batch_sampler: the global batch order from a data position on, endlessly, this process's
    share of it.

    Every process walks the same global order (`BucketBatchSampler.batches_for_epoch`) and takes every
    world-th batch, so the global batch of a step is the same whatever the number of processes. Each yielded
    batch is a list of keys (index, epoch, place, after): `place` is the batch's own position (it seeds the
    batch's noise) and `after` the data position once every process has taken its batch of that group: what
    a checkpoint must store. Positions follow the loop's counter exactly: an epoch is entered when the next
    batch is drawn, so after the last batch of epoch E the position is (E, batches per epoch).
    """

    def __init__(self, sampler: BucketBatchSampler, start: Position, *, world: int = 1, rank: int = 0) -> None:
        self.sampler = sampler
        self.start = start
        self.world = world
        self.rank = rank

    def __iter__(self) -> Iterator[list[tuple[int, int, int, Position]]]:
        epoch, place = self.start
        order = self.sampler.batches_for_epoch(epoch)
        while True:
            group = []
            for _ in range(self.world):
                if place >= len(order):
                    epoch, place = epoch + 1, 0
                    order = self.sampler.batches_for_epoch(epoch)
                group.append((epoch, place, order[place]))
                place += 1
            mine_epoch, mine_place, indices = group[self.rank]
            yield [(index, mine_epoch, mine_place, (epoch, place)) for index in indices]


class ExampleDataset(torch.utils.data.Dataset):
    """`DatasetView.example` addressed by the sampler's keys, so DataLoader workers decode the images.

    An example is a pure function of (seed, epoch, index): which process or worker builds it changes
    nothing. `decoded_in` records the process that did (the training process when there are no workers).
    """

    def __init__(self, view: DatasetView, *, with_pixels: bool) -> None:
        self.view = view
        self.with_pixels = with_pixels

    def __len__(self) -> int:
        return len(self.view)

    def __getitem__(self, key: tuple[int, int, int, Position]) -> dict[str, Any]:
        index, epoch, place, after = key
        example = self.view.example(index, epoch, with_pixels=self.with_pixels)
        example.update(index=index, position=(epoch, place), next_position=after, decoded_in=os.getpid())
        return example


def collate_positioned(examples: list[dict[str, Any]]) -> dict[str, Any]:
    """`collate`, with the batch's position and the data position after it as single values."""
    batch = collate(examples)
    batch["position"] = tuple(examples[0]["position"])
    batch["next_position"] = tuple(examples[0]["next_position"])
    return batch


class BatchFeed:
    """A torch DataLoader over the view, from a data position on: workers decode and prefetch the next
    batches while the training process runs the current step.

    `position` is the data position after the last batch taken. `next(feed)` returns the next collated batch;
    `restart(position)` starts the order again elsewhere (after a resume), keeping the worker processes.
    """

    def __init__(self, view: DatasetView, sampler: BucketBatchSampler, start: Position, *, with_pixels: bool,
                 num_workers: int = 0, world: int = 1, rank: int = 0, pin_memory: bool = False,
                 prefetch_factor: int = 2) -> None:
        self.batch_sampler = ShardedBatchSampler(sampler, start, world=world, rank=rank)
        workers = dict(prefetch_factor=prefetch_factor, persistent_workers=True) if num_workers > 0 else {}
        self.loader = torch.utils.data.DataLoader(
            ExampleDataset(view, with_pixels=with_pixels), batch_sampler=self.batch_sampler,
            collate_fn=collate_positioned, num_workers=num_workers, pin_memory=pin_memory,
            # Its own generator: making an iterator draws a seed, and that must not move the global torch
            # RNG (LoRA dropout draws from it; a resumed run makes its iterator at another step).
            generator=torch.Generator().manual_seed(0), **workers)
        self.position = tuple(start)
        self._iterator = iter(self.loader)

    def restart(self, start: Position) -> None:
        self.batch_sampler.start = tuple(start)
        self.position = tuple(start)
        self._iterator = iter(self.loader)  # persistent workers drop what they prefetched and start again

    def __next__(self) -> dict[str, Any]:
        batch = next(self._iterator)
        self.position = tuple(batch["next_position"])  # a tuple whatever pin_memory's thread made of it
        return batch


# --------------------------------------------------------------------------- caches


class NonFiniteCacheError(ValueError):
    """A cached tensor holds NaN or Inf; training on it would poison the run."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        super().__init__(
            f"VAE latents for {self.path} contain NaN or Inf values: the VAE overflowed on this image "
            "(common with the SDXL VAE in float16); encode in float32 or use an fp16-fixed VAE."
        )


def check_finite(latents: torch.Tensor, path: Path | str) -> None:
    """Raise NonFiniteCacheError naming `path` if `latents` holds NaN or Inf."""
    if not bool(torch.isfinite(latents).all()):
        raise NonFiniteCacheError(path)


class _TensorStore:
    """A dict of tensor groups, or a folder of safetensors files (one per key).

    With a folder nothing is kept in memory: latents of a large SDXL dataset
    can exceed RAM, and the OS file cache already makes re-reads cheap.
    """

    def __init__(self, folder: Path | None) -> None:
        self.folder = Path(folder) if folder is not None else None
        self._memory: dict[str, dict[str, torch.Tensor]] = {}
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)

    def load(self, key: str) -> dict[str, torch.Tensor] | None:
        if self.folder is None:
            return self._memory.get(key)
        file = self.folder / f"{key}.safetensors"
        if not file.is_file():
            return None
        try:
            return load_file(file)
        except Exception:
            # A half-written or corrupt cache file is just a cache miss; the
            # next save replaces it.
            return None

    def save(self, key: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        # Copy: a row of the encoder's batch would otherwise keep the whole batch alive.
        tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
        if self.folder is None:
            self._memory[key] = tensors
            return
        # Write then rename, so a crash never leaves a truncated cache file.
        with atomic_path(self.folder / f"{key}.safetensors") as tmp:
            save_file(tensors, str(tmp), metadata=metadata)


_file_hashes: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path | str) -> str:
    """sha256 of a file's bytes (remembered per path, mtime and size for the life of the process)."""
    path = Path(path).resolve()
    stat = path.stat()
    memo = (str(path), stat.st_mtime_ns, stat.st_size)
    if memo not in _file_hashes:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        _file_hashes[memo] = digest.hexdigest()
    return _file_hashes[memo]


def module_fingerprint(module: torch.nn.Module) -> str:
    """sha256 of a module's class, config and every weight (names, dtypes, shapes, bytes): the identity of a
    VAE for a cache shared between runs. A fine-tuned VAE, or the same one in another precision, differs."""
    digest = hashlib.sha256(type(module).__name__.encode())
    config = getattr(module, "config", None)
    if config is not None:
        digest.update(repr(sorted(dict(config).items())).encode())
    for name, tensor in module.state_dict().items():
        tensor = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class LatentCache:
    """VAE latents per (image, bucket), in memory or in a folder of safetensors files.

    `build(view, encode_fn)` encodes every image not cached yet, where
    `encode_fn(pixel_values)` takes a (B, 3, H, W) tensor in [-1, 1] and
    returns (B, C, h, w) latents, already scaled as the loop wants them.
    After that, `get`/`get_batch` only read: the cache keeps no reference to
    the VAE, so the loop may move it off the GPU.

    The key is sha256 of the image's bytes, the bucket, the crop (center) and
    flip (none), and `model_id`, so the same picture under another path or in
    another run hits the entry, and an edited image or another VAE misses it;
    `model_id` should name the VAE's weights and dtype (`module_fingerprint`).
    Latents are checked for NaN/Inf when computed and when read back.
    `reused` counts the entries the last `build` found already cached.
    """

    def __init__(self, folder: Path | None = None, *, model_id: str) -> None:
        self.model_id = model_id
        self._store = _TensorStore(folder)
        self._keys: list[str] = []
        self._paths: list[Path] = []
        self.reused = 0

    def key(self, path: Path, bucket: Bucket) -> str:
        text = f"latents-v2|{file_sha256(path)}|{bucket[0]}x{bucket[1]}|crop=center|flip=none|{self.model_id}"
        return hashlib.sha256(text.encode()).hexdigest()

    def build(
        self,
        view: DatasetView,
        encode_fn: Callable[[torch.Tensor], torch.Tensor],
        *,
        batch_size: int = 1,
        disable: bool = False,
    ) -> int:
        """Encode every item of `view` not cached yet, batched per bucket; return how many were encoded.

        batch_size defaults to 1 because a VAE encode at SDXL resolution is
        memory hungry and this runs once; raise it when VRAM allows.
        """
        if not view.fixed_augmentation:
            raise ValueError(
                "Latents cannot be cached while random crop or flip is on, because each epoch sees different "
                "pixels: create the DatasetView with cache_latents=True (which turns them off) "
                "or turn off latent caching."
            )
        self._paths = [item.path for item in view.items]
        self._keys = [self.key(item.path, bucket) for item, bucket in zip(view.items, view.item_buckets, strict=True)]
        missing: dict[Bucket, list[int]] = {}
        for index, key in enumerate(self._keys):
            if self._store.load(key) is None:
                missing.setdefault(view.item_buckets[index], []).append(index)
        total = sum(len(indices) for indices in missing.values())
        self.reused = len(self._keys) - total
        with tqdm(total=total, desc="Caching latents", unit="img", disable=disable) as progress:
            for indices in missing.values():
                for start in range(0, len(indices), batch_size):
                    chunk = indices[start : start + batch_size]
                    pixel_values = torch.stack([view.center_pixel_values(i) for i in chunk])
                    with torch.no_grad():
                        latents = encode_fn(pixel_values)
                    for row, index in enumerate(chunk):
                        check_finite(latents[row], self._paths[index])
                        metadata = {"path": str(self._paths[index]), "model_id": self.model_id}
                        self._store.save(self._keys[index], {"latents": latents[row]}, metadata)
                    progress.update(len(chunk))
        return total

    def get(self, index: int) -> torch.Tensor:
        """Latents (C, h, w) of item `index` of the view passed to `build`."""
        if not 0 <= index < len(self._keys):
            raise KeyError(f"No latents for item {index}: call build() with the dataset view first.")
        stored = self._store.load(self._keys[index])
        if stored is None:
            raise KeyError(
                f"Latents for {self._paths[index]} are not cached (the cache file went missing): run build() again."
            )
        check_finite(stored["latents"], self._paths[index])  # a bad file from an older run must not slip through
        return stored["latents"]

    def get_batch(self, indices: Sequence[int]) -> torch.Tensor:
        return torch.stack([self.get(index) for index in indices])


class EmbeddingCache:
    """Text-encoder outputs per caption text, in memory or in a folder.

    `build(view, encode_fn)` encodes every distinct caption of the view, where
    `encode_fn(captions)` returns a dict of batch-first tensors (for example
    {"prompt_embeds": ..., "pooled_prompt_embeds": ...}); `get` returns that
    dict for one caption without the batch dimension, `get_batch` stacks.
    Only valid while each image's caption text is fixed: tag shuffle and tag
    dropout change it every step, so `build` refuses them. Whole-caption
    dropout is fine: the empty caption is cached too. Size-dependent
    conditioning (SDXL time ids) is not text and is not cached here.
    """

    def __init__(self, folder: Path | None = None, *, model_id: str) -> None:
        self.model_id = model_id
        self._store = _TensorStore(folder)

    def key(self, caption: str) -> str:
        return hashlib.sha1(f"embeddings-v1|{self.model_id}|{caption}".encode()).hexdigest()

    def build(
        self,
        view: DatasetView,
        encode_fn: Callable[[list[str]], dict[str, torch.Tensor]],
        *,
        batch_size: int = 8,
        disable: bool = False,
    ) -> int:
        """Encode every distinct caption of `view` not cached yet; return how many were encoded."""
        if view.shuffle_caption or view.tag_dropout > 0:
            raise ValueError(
                "Text embeddings cannot be cached while caption shuffle or tag dropout is on, because the caption "
                "changes every step: turn those off or turn off text-embedding caching."
            )
        captions = {item.caption for item in view.items} | ({""} if view.caption_dropout > 0 else set())
        missing = [caption for caption in sorted(captions) if self._store.load(self.key(caption)) is None]
        with tqdm(total=len(missing), desc="Caching text embeddings", unit="caption", disable=disable) as progress:
            for start in range(0, len(missing), batch_size):
                chunk = missing[start : start + batch_size]
                with torch.no_grad():
                    outputs = encode_fn(chunk)
                for row, caption in enumerate(chunk):
                    tensors = {name: tensor[row] for name, tensor in outputs.items()}
                    self._store.save(self.key(caption), tensors, {"caption": caption, "model_id": self.model_id})
                progress.update(len(chunk))
        return len(missing)

    def get(self, caption: str) -> dict[str, torch.Tensor]:
        stored = self._store.load(self.key(caption))
        if stored is None:
            raise KeyError(
                f"No cached text embedding for caption {caption!r}: call build() with the dataset view first."
            )
        return stored

    def get_batch(self, captions: Sequence[str]) -> dict[str, torch.Tensor]:
        rows = [self.get(caption) for caption in captions]
        return {name: torch.stack([row[name] for row in rows]) for name in rows[0]}
