"""Validation loss that means something from one step to the next, and across resumes.

Every number here is a pure function of the adapter weights: the images are fixed (a held-out split, or a
fixed subset of the training images), encoded once with the VAE's mean (no sampling), and each image is
measured at the same evenly spread timesteps with the same noise, drawn from seeds derived from the run seed
and the image's path. LoRA dropout is off while measuring and the loop's own generator is never touched, so
measuring never changes the training trajectory.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from ..config import AUTO_SPLIT_MIN_IMAGES, AUTO_VALIDATION_SPLIT, ConfigError, TrainConfig
from ..data.dataset import DatasetView, derive_seed
from ..data.scan import DataItem, DatasetScan
from .guards.verdicts import Event
from .forward import predict_and_loss
from .noise import noised
from .observers import NOTHING, Observation, Observer
from .placement import on_device
from .session import Session

VAL_LOSS_FILE = "val_loss.jsonl"


# ---- which images ---------------------------------------------------------------------------------------
def split_validation(scan: DatasetScan, config: TrainConfig) -> tuple[DatasetScan, list[DataItem]]:
    """(training scan, held-out items). The held-out images are chosen by the seed alone and never trained."""
    split = effective_validation_split(config, len(scan.items))
    if split <= 0:
        return scan, []
    items = sorted(scan.items, key=lambda item: str(item.path))
    if len(items) < 2:
        raise ConfigError([f"validation_split {config.validation_split} holds images out, but the dataset has "
                           f"only {len(items)} image; set validation_split to 0."])
    count = min(len(items) - 1, max(1, math.ceil(split * len(items))))
    random.Random(derive_seed("holdout", config.seed)).shuffle(items)
    held = {item.path for item in items[:count]}
    kept = [item for item in scan.items if item.path not in held]
    return dataclasses.replace(scan, items=kept), [item for item in items[:count]]  # its notes stay


def effective_validation_split(config: TrainConfig, image_count: int) -> float:
    """The configured split, or (left empty) the automatic one for datasets big enough to spare images."""
    if config.validation_split is not None:
        return config.validation_split
    if config.validation_loss_every and image_count >= AUTO_SPLIT_MIN_IMAGES:
        return AUTO_VALIDATION_SPLIT
    return 0.0


def validation_items(s: Session) -> tuple[list[DataItem], bool]:
    """The images measured (at most validation_count) and whether they are held out of training."""
    held = list(getattr(s, "validation_items", None) or [])
    if held:
        return held[: s.config.validation_count], True
    return list(s.data.items[: s.config.validation_count]), False


# ---- the fixed set ---------------------------------------------------------------------------------------
@dataclass
class FixedSet:
    """Latents, captions, sizes, noise and timesteps of a fixed validation set, on the training device."""

    latents: list[torch.Tensor] = field(default_factory=list)  # per image: 1 x C x h x w
    noise: list[torch.Tensor] = field(default_factory=list)  # per image: K x C x h x w
    captions: list[str] = field(default_factory=list)
    sizes: list[dict[str, tuple[int, int]]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    timesteps: torch.Tensor | None = None  # K
    # Per image: its caption's text-encoder output (1 x ...), when the text encoders are not trained (their
    # output cannot change, and they may be waiting on the CPU once training captions are cached).
    text: list[dict[str, torch.Tensor]] | None = None

    def __len__(self) -> int:
        return len(self.latents)


@torch.no_grad()
def build_fixed_set(s: Session, items: list[DataItem], timesteps: torch.Tensor, *, purpose: str = "val") -> FixedSet:
    """Encode `items` once (center crop, no flip, the caption as written) with fixed noise per image.

    The VAE (and the frozen text encoders) may wait on the CPU after caching (placement.py): they come to the
    training device for this and go back."""
    config = s.config
    view = DatasetView(DatasetScan(Path(config.train_data_dir), list(items)), config.resolution,
                       enable_bucket=config.enable_bucket, bucket_step=config.bucket_step,
                       min_bucket_size=config.min_bucket_reso, max_bucket_size=config.max_bucket_reso,
                       random_crop=False, flip_prob=0.0, seed=config.seed)
    out = FixedSet(timesteps=timesteps.to(s.device))
    examples = [view.example(i, 0) for i in range(len(items))]
    with on_device([s.bundle.vae], s.device):
        encoded = [s.bundle.family.encode_latents(s.bundle, e["pixel_values"][None]) for e in examples]
    for i, (item, example) in enumerate(zip(items, examples)):
        latents = encoded[i]
        generator = torch.Generator().manual_seed(derive_seed(purpose, config.seed, Path(item.path).name) % 2**63)
        noise = torch.randn((len(timesteps), *latents.shape[1:]), generator=generator)
        out.latents.append(latents)
        out.noise.append(noise.to(s.device))
        out.captions.append(item.caption)
        out.sizes.append({k: example[k] for k in ("original_size", "crop_top_left", "target_size")})
        out.paths.append(str(item.path))
    if not config.train_text_encoder and items:
        with on_device(s.bundle.text_encoders, s.device), s.amp.autocast():
            text = s.bundle.family.encode_text(s.bundle, out.captions)
        out.text = [{k: v[i : i + 1].to(s.device) for k, v in text.items()} for i in range(len(items))]
    return out


_MODE_DEPENDENT = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
                   torch.nn.AlphaDropout, torch.nn.modules.batchnorm._BatchNorm)
_mode_modules: dict[int, list[torch.nn.Module]] = {}


@contextlib.contextmanager
def eval_mode(s: Session) -> Iterator[None]:
    """LoRA dropout (and any other mode-dependent layer) off in every trained module, restored afterwards.

    Only the modules whose behaviour depends on the mode are flipped: module.eval() on a whole UNet walks
    thousands of modules and costs more than a small forward pass.
    """
    found = []
    for module in s.trained.values():
        key = id(module)
        if key not in _mode_modules:
            _mode_modules[key] = [m for m in module.modules() if isinstance(m, _MODE_DEPENDENT)]
        found.extend(_mode_modules[key])
    was = [m.training for m in found]
    for m in found:
        m.training = False
    try:
        yield
    finally:
        for m, training in zip(found, was):
            m.training = training


def _conditioning(s: Session, captions: list[str], sizes: list[dict]) -> Any:
    with s.amp.autocast():
        text = s.bundle.family.encode_text(s.bundle, captions)
    return s.bundle.family.make_conditioning(s.bundle, text, sizes)


def fixed_conditioning(s: Session, fixed: FixedSet, indices: list[int]) -> Any:
    """The conditioning of images `indices` of `fixed`: from the text encoded at build time, or encoded now
    (when the text encoders train)."""
    sizes = [fixed.sizes[i] for i in indices]
    if fixed.text is None:
        return _conditioning(s, [fixed.captions[i] for i in indices], sizes)
    text = {k: torch.cat([fixed.text[i][k] for i in indices]) for k in fixed.text[indices[0]]}
    return s.bundle.family.make_conditioning(s.bundle, text, sizes)


@torch.no_grad()
def fixed_set_loss(s: Session, fixed: FixedSet) -> float:
    """Mean diffusion loss (no SNR weighting) over every image and fixed timestep of `fixed`.

    Rows (image x timestep) of the same latent size go through the UNet together, in chunks of twice the
    training micro-batch (no gradients, so that fits wherever training fits).
    """
    k = len(fixed.timesteps)
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, latents in enumerate(fixed.latents):
        by_shape.setdefault(tuple(latents.shape), []).append(i)
    chunk = max(k, 2 * max(1, s.state.micro_batch_size))
    total, count = 0.0, 0
    with eval_mode(s):
        for indices in by_shape.values():
            clean = torch.cat([fixed.latents[i].expand(k, *fixed.latents[i].shape[1:]) for i in indices])
            noise = torch.cat([fixed.noise[i] for i in indices])
            timesteps = fixed.timesteps.repeat(len(indices))
            cond = fixed_conditioning(s, fixed, indices)
            cond = cond.index(torch.arange(len(indices), device=s.device).repeat_interleave(k))
            for rows in (slice(a, a + chunk) for a in range(0, len(timesteps), chunk)):
                loss = _loss_of(s, clean[rows], noise[rows], timesteps[rows], cond.index(rows))
                total += float(loss.sum())
                count += loss.numel()
    return total / max(count, 1)


def _loss_of(s: Session, clean: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor,
             cond: Any) -> torch.Tensor:
    noisy = s.objective.noisy_input(clean, noise, timesteps)
    target = s.objective.target(clean, noise, timesteps)
    return _plain_loss(s, noisy, target, timesteps, cond)


def _plain_loss(s: Session, noisy: torch.Tensor, target: torch.Tensor, timesteps: torch.Tensor,
                cond: Any) -> torch.Tensor:
    """Per-sample loss without SNR weighting: the same number whatever loss options the run trains with."""
    _, loss = predict_and_loss(s.objective, s.trained["unet"], noisy, target, timesteps, cond, dtype=s.weight_dtype,
                               autocast=s.amp.autocast)
    return loss


@torch.no_grad()
def fixed_batch_loss(s: Session, batch: dict[str, Any], *, seed: int = 1234) -> float:
    """Mean loss of a collated `batch` with noise and timesteps drawn from `seed` alone (LoRA dropout off)."""
    from .step import conditioning_for, latents_for

    with eval_mode(s):
        latents = latents_for(s, batch)
        generator = torch.Generator().manual_seed(seed)
        noisy, noise, timesteps = noised(s.objective, latents, generator)
        target = s.objective.target(latents, noise, timesteps)
        cond = conditioning_for(s, batch, slice(0, latents.shape[0]))
        return float(_plain_loss(s, noisy, target, timesteps, cond).mean())


# ---- the observer ----------------------------------------------------------------------------------------
class ValidationLoss(Observer):
    """Every `validation_loss_every` steps: the fixed-set loss, into diagnostics/val_loss.jsonl and into the
    step's metrics as `val_loss` (which early stopping and the plateau scheduler read)."""

    name = "validation_loss"

    def __init__(self, config: TrainConfig) -> None:
        self.every = config.validation_loss_every
        self.history: list[tuple[int, float]] = []
        self.fixed: FixedSet | None = None
        self.held_out = False
        self.seconds = 0.0  # time spent measuring, for the overhead benchmark

    def fixed_set(self, s: Session) -> FixedSet:
        """The fixed set, built when first measured, not before step 1: a run whose first validation is at step
        100 (or never, when validation_loss_every > max steps) should not wait for it at start-up."""
        if self.fixed is not None:
            return self.fixed
        import time

        start = time.perf_counter()
        items, self.held_out = validation_items(s)
        timesteps = s.objective.validation_timesteps(s.config.validation_timesteps)
        self.fixed = build_fixed_set(s, items, timesteps)
        self.seconds += time.perf_counter() - start
        return self.fixed

    def described(self, s: Session) -> Event:
        what = "held-out" if self.held_out else "training (not held out: this shows divergence, not overfitting)"
        return Event("validation", f"Validation loss every {self.every} steps on {len(self.fixed)} {what} images "
                     f"at timesteps {self.fixed.timesteps.tolist()} with fixed noise.",
                     fields=dict(step=s.state.step, held_out=self.held_out, paths=self.fixed.paths))

    def measure(self, s: Session) -> float:
        return fixed_set_loss(s, self.fixed_set(s))

    def observe(self, s: Session) -> Observation:
        if not self.every or s.state.step % self.every:
            return NOTHING
        import time

        first = self.fixed is None
        start = time.perf_counter()
        value = self.measure(s)
        self.history.append((s.state.step, value))
        if s.run.enabled:
            from ..runs.jsonfiles import append_jsonl

            append_jsonl(s.run.paths.diagnostics / VAL_LOSS_FILE,
                         {"step": s.state.step, "val_loss": value, "held_out": self.held_out,
                          "images": len(self.fixed), "timesteps": self.fixed.timesteps.tolist()})
        self.seconds += time.perf_counter() - start
        return Observation({"val_loss": value}, (self.described(s),) if first else ())

    def state_dict(self) -> dict[str, Any]:
        return {"history": [[step, value] for step, value in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = [(int(step), float(value)) for step, value in state.get("history", [])]
