"""Caches of what a run would otherwise compute every step: VAE latents per (image, bucket) and text-encoder outputs
per caption, in memory or in a folder of safetensors files (written atomically, read back checked)."""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..atomic import atomic_path
from ..digest import sha256_file
from .examples import DatasetView
from .order import Bucket


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
        except (SafetensorError, OSError):
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
        _file_hashes[memo] = sha256_file(path)
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
