"""Validation loss that means something from one step to the next, and across resumes.

Every number here is a pure function of the adapter weights: the images are fixed (a held-out split, or a
fixed subset of the training images), encoded once with the VAE's mean (no sampling), and each image is
measured at the same evenly spread timesteps (the objective's `validation_timesteps`) with the same noise, drawn
from seeds derived from the run seed and the image's path. LoRA dropout is off while measuring and no training
generator is touched, so measuring never changes the training trajectory.

The loss is also reported per noise band (the objective's `noise_level` of each fixed timestep): low (t < 250 of
1000), mid (250 <= t < 750) and high (t >= 750); an overfitting LoRA shows first where little noise is left.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from ...config import AUTO_SPLIT_MIN_IMAGES, AUTO_VALIDATION_SPLIT, ConfigError, TrainConfig
from ...data.examples import DatasetView
from ...data.scan import DataItem, DatasetScan
from ...data.seeds import derive_seed
from ...models.base import Conditioning, ModelBundle, Objective
from ...runs import events
from ...runs.jsonfiles import append_jsonl
from ..amp import MixedPrecision
from ..forward import predict, predict_and_loss
from ..guards.verdicts import Event
from ..inputs import BatchInputs
from ..noise import noised
from .base import NOTHING, Observation, Observer, ObserverView
from ..placement import on_device

#: Noise bands of the validation loss: (metric key, lowest noise level in the band); a band ends where the next
#: begins. On SD's 1000-step schedule: t < 250, 250 <= t < 750, t >= 750.
NOISE_BANDS = (("val_loss_low_noise", 0.0), ("val_loss_mid_noise", 0.25), ("val_loss_high_noise", 0.75))


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


@dataclass(frozen=True)
class Measurement:
    loss: float  # mean over every image and fixed timestep
    bands: dict[str, float]  # NOISE_BANDS key -> mean over the rows in that band (bands without a row are left out)


_MODE_DEPENDENT = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
                   torch.nn.AlphaDropout, torch.nn.modules.batchnorm._BatchNorm)


class Evaluator:
    """Measures the trained model without changing it: fixed sets, their loss, and a forward pass for probes.

    A handle the validation-loss and activation observers get when they are made; it holds the run's fixed
    wiring (model, objective, mixed precision, the images to measure on) and never touches a training generator.
    """

    def __init__(self, config: TrainConfig, bundle: ModelBundle, objective: Objective,
                 trained: dict[str, torch.nn.Module], amp: MixedPrecision, device: torch.device,
                 data: DatasetView, validation_items: list[DataItem], inputs: BatchInputs) -> None:
        self.config, self.bundle, self.objective = config, bundle, objective
        self.trained, self.amp, self.device = trained, amp, device
        self.data, self.validation_items, self.inputs = data, validation_items, inputs
        self._mode_modules: list[torch.nn.Module] | None = None

    @property
    def denoiser(self) -> torch.nn.Module:
        return self.trained["unet"]

    def items(self) -> tuple[list[DataItem], bool]:
        """The images measured (at most validation_count) and whether they are held out of training."""
        if self.validation_items:
            return list(self.validation_items[: self.config.validation_count]), True
        return list(self.data.items[: self.config.validation_count]), False

    @torch.no_grad()
    def fixed_set(self, items: list[DataItem], timesteps: torch.Tensor, *, purpose: str = "val") -> FixedSet:
        """Encode `items` once (center crop, no flip, the caption as written) with fixed noise per image.

        The VAE (and the frozen text encoders) may wait on the CPU after caching (placement.py): they come to
        the training device for this and go back."""
        config, bundle = self.config, self.bundle
        as_written = config.model_copy(update=dict(center_crop=True, random_flip=False, shuffle_caption=False,
                                                   caption_dropout_rate=0.0, caption_tag_dropout_rate=0.0))
        view = DatasetView(DatasetScan(Path(config.train_data_dir), list(items)), as_written)
        out = FixedSet(timesteps=timesteps.to(self.device))
        examples = [view.example(i, 0) for i in range(len(items))]
        with on_device([bundle.vae], self.device):
            encoded = [bundle.family.encode_latents(bundle, e["pixel_values"][None]) for e in examples]
        for item, example, latents in zip(items, examples, encoded):
            generator = torch.Generator().manual_seed(derive_seed(purpose, config.seed, Path(item.path).name) % 2**63)
            noise = torch.randn((len(timesteps), *latents.shape[1:]), generator=generator)
            out.latents.append(latents)
            out.noise.append(noise.to(self.device))
            out.captions.append(item.caption)
            out.sizes.append({k: example[k] for k in ("original_size", "crop_top_left", "target_size")})
            out.paths.append(str(item.path))
        if not (config.train_text_encoder or config.pivotal_tokens) and items:  # else the text changes as it trains
            with on_device(bundle.text_encoders, self.device), self.amp.autocast():
                text = bundle.family.encode_text(bundle, out.captions)
            out.text = [{k: v[i : i + 1].to(self.device) for k, v in text.items()} for i in range(len(items))]
        return out

    @contextlib.contextmanager
    def eval_mode(self) -> Iterator[None]:
        """LoRA dropout (and any other mode-dependent layer) off in every trained module, restored afterwards.

        Only the modules whose behaviour depends on the mode are flipped: module.eval() on a whole UNet walks
        thousands of modules and costs more than a small forward pass.
        """
        if self._mode_modules is None:
            self._mode_modules = [m for module in self.trained.values() for m in module.modules()
                                  if isinstance(m, _MODE_DEPENDENT)]
        found = self._mode_modules
        was = [m.training for m in found]
        for m in found:
            m.training = False
        try:
            yield
        finally:
            for m, training in zip(found, was):
                m.training = training

    def conditioning(self, fixed: FixedSet, indices: list[int]) -> Conditioning:
        """The conditioning of images `indices` of `fixed`: from the text encoded at build time, or encoded now
        (when the text encoders train)."""
        family, sizes = self.bundle.family, [fixed.sizes[i] for i in indices]
        if fixed.text is None:
            with self.amp.autocast():
                text = family.encode_text(self.bundle, [fixed.captions[i] for i in indices])
            return family.make_conditioning(self.bundle, text, sizes)
        text = {k: torch.cat([fixed.text[i][k] for i in indices]) for k in fixed.text[indices[0]]}
        return family.make_conditioning(self.bundle, text, sizes)

    def plain_loss(self, noisy: torch.Tensor, target: torch.Tensor, timesteps: torch.Tensor,
                   cond: Conditioning) -> torch.Tensor:
        """Per-sample loss without the objective's weights: the same number whatever loss options the run has."""
        _, loss = predict_and_loss(self.objective, self.denoiser, noisy, target, timesteps, cond,
                                   dtype=self.amp.weight_dtype, autocast=self.amp.autocast)
        return loss

    @torch.no_grad()
    def fixed_set_loss(self, fixed: FixedSet, micro_batch_size: int) -> Measurement:
        """Mean loss (no weighting) over every image and fixed timestep of `fixed`, and per noise band.

        Rows (image x timestep) of the same latent size go through the denoiser together, in chunks of twice the
        training micro-batch (no gradients, so that fits wherever training fits).
        """
        objective, k = self.objective, len(fixed.timesteps)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, latents in enumerate(fixed.latents):
            by_shape.setdefault(tuple(latents.shape), []).append(i)
        chunk = max(k, 2 * max(1, micro_batch_size))
        total, count = 0.0, 0
        band_sums, band_counts = [0.0] * len(NOISE_BANDS), [0] * len(NOISE_BANDS)
        with self.eval_mode():
            for indices in by_shape.values():
                clean = torch.cat([fixed.latents[i].expand(k, *fixed.latents[i].shape[1:]) for i in indices])
                noise = torch.cat([fixed.noise[i] for i in indices])
                timesteps = fixed.timesteps.repeat(len(indices))
                cond = self.conditioning(fixed, indices)
                cond = cond.index(torch.arange(len(indices), device=self.device).repeat_interleave(k))
                for rows in (slice(a, a + chunk) for a in range(0, len(timesteps), chunk)):
                    t = timesteps[rows]
                    noisy = objective.noisy_input(clean[rows], noise[rows], t)
                    loss = self.plain_loss(noisy, objective.target(clean[rows], noise[rows], t), t, cond.index(rows))
                    total += float(loss.sum())
                    count += loss.numel()
                    band = noise_band(objective.noise_level(t))
                    for b in range(len(NOISE_BANDS)):
                        rows_in_band = band == b
                        if rows_in_band.any():
                            band_sums[b] += float(loss[rows_in_band].sum())
                            band_counts[b] += int(rows_in_band.sum())
        bands = {key: band_sums[b] / band_counts[b] for b, (key, _) in enumerate(NOISE_BANDS) if band_counts[b]}
        return Measurement(total / max(count, 1), bands)

    @torch.no_grad()
    def batch_loss(self, batch: dict[str, Any], *, seed: int = 1234) -> float:
        """Mean loss of a collated `batch` with noise, timesteps (and, without a latent cache, the VAE's posterior
        sample) drawn from `seed` alone, LoRA dropout off."""
        batch = {**batch, "position": ("fixed batch", seed)}  # the batch's generators: seeded by `seed` alone
        with self.eval_mode():
            latents = self.inputs.latents(batch)
            noisy, noise, timesteps = noised(self.objective, latents, torch.Generator().manual_seed(seed))
            target = self.objective.target(latents, noise, timesteps)
            cond = self.inputs.conditioning(batch, slice(0, latents.shape[0]))
            return float(self.plain_loss(noisy, target, timesteps, cond).mean())

    @torch.no_grad()
    def probe_forward(self, probe: FixedSet) -> None:
        """One forward pass of the first image of `probe` at its timestep (dropout off), for forward hooks."""
        with self.eval_mode():
            noisy = self.objective.noisy_input(probe.latents[0], probe.noise[0], probe.timesteps)
            predict(self.objective, self.denoiser, noisy, probe.timesteps, self.conditioning(probe, [0]),
                    dtype=self.amp.weight_dtype, autocast=self.amp.autocast)


def noise_band(levels: torch.Tensor) -> torch.Tensor:
    """The NOISE_BANDS index of each noise level in [0, 1]."""
    edges = torch.tensor([low for _, low in NOISE_BANDS[1:]], dtype=levels.dtype, device=levels.device)
    return torch.bucketize(levels, edges, right=True)


# ---- the observer ----------------------------------------------------------------------------------------
class ValidationLoss(Observer):
    """Every `validation_loss_every` steps: the fixed-set loss, into diagnostics/val_loss.jsonl and into the
    step's metrics as `val_loss` and its noise bands (early stopping and the plateau scheduler read `val_loss`)."""

    name = "validation_loss"

    def __init__(self, config: TrainConfig, evaluator: Evaluator) -> None:
        self.every = config.validation_loss_every
        self.timesteps = config.validation_timesteps
        self.evaluator = evaluator
        self.history: list[tuple[int, float]] = []
        self.fixed: FixedSet | None = None
        self.held_out = False
        self.seconds = 0.0  # time spent measuring, for the overhead benchmark

    def fixed_set(self) -> FixedSet:
        """The fixed set, built when first measured, not before step 1: a run whose first validation is at step
        100 (or never, when validation_loss_every > max steps) should not wait for it at start-up."""
        if self.fixed is None:
            start = time.perf_counter()
            items, self.held_out = self.evaluator.items()
            timesteps = self.evaluator.objective.validation_timesteps(self.timesteps)
            self.fixed = self.evaluator.fixed_set(items, timesteps)
            self.seconds += time.perf_counter() - start
        return self.fixed

    def described(self, step: int) -> Event:
        what = "held-out" if self.held_out else "training (not held out: this shows divergence, not overfitting)"
        return Event(events.VALIDATION, f"Validation loss every {self.every} steps on {len(self.fixed)} {what} images "
                     f"at timesteps {self.fixed.timesteps.tolist()} with fixed noise.",
                     fields=dict(step=step, held_out=self.held_out, paths=self.fixed.paths))

    def measure(self, view: ObserverView) -> Measurement:
        return self.evaluator.fixed_set_loss(self.fixed_set(), view.micro_batch_size)

    def observe(self, view: ObserverView) -> Observation:
        if not self.every or view.step % self.every:
            return NOTHING
        first = self.fixed is None
        start = time.perf_counter()
        measured = self.measure(view)
        self.history.append((view.step, measured.loss))
        if view.run_paths is not None:
            append_jsonl(view.run_paths.val_loss,
                         {"step": view.step, "val_loss": measured.loss, **measured.bands, "held_out": self.held_out,
                          "images": len(self.fixed), "timesteps": self.fixed.timesteps.tolist()})
        self.seconds += time.perf_counter() - start
        return Observation({"val_loss": measured.loss, **measured.bands},
                           (self.described(view.step),) if first else ())

    def state_dict(self) -> dict[str, Any]:
        return {"history": [[step, value] for step, value in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = [(int(step), float(value)) for step, value in state.get("history", [])]
