"""Per-image losses of a run, and the ranking that points at the images the model cannot fit.

The training loop appends one line per optimizer step to `RUN/diagnostics/image_losses.jsonl` (line-atomic,
`runs.jsonfiles.append_jsonl`), built by `runs.image_losses.loss_record`:

    {"step": 120, "paths": ["/data/10_cat/a.png", ...], "losses": [0.081, ...], "timesteps": [523, ...],
     "reg": [false, ...]}

one entry per sample of the step's micro-batches: the image's path as the dataset scan gave it (`DataItem.path`),
its loss as the mean squared error of the prediction over the latent elements (mask-weighted mean when a
loss mask is used), *before* any per-timestep weighting (min-SNR, debiased estimation) and before
`prior_loss_weight`, the timestep it was noised at (a flow model: its sigma), and whether it is a class
image. Only the main process writes.

A raw loss says more about the timestep than about the image (at small timesteps the noise is hard to
predict for every image), so the ranking compares each sample with the median loss of all samples at a
similar timestep (ten equal-count timestep bins) and scores an image by the geometric mean of those ratios
over its samples, from the second half of the run when that half saw most images (early losses measure the
base model, not what the LoRA failed to learn). A score of 1.0 is a typical image; the doctor flags images at
`FLAG_RATIO` and above: the model keeps missing them by half again the usual error.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ..runs.image_losses import loss_record  # noqa: F401  (the record's format lives with the run folder)
from ..runs.layout import RunPaths

FLAG_RATIO = 1.5
BINS = 10


def image_losses_path(run_dir: Path | str) -> Path:
    return RunPaths(Path(run_dir)).image_losses


@dataclass(frozen=True)
class Sample:
    step: int
    path: str
    loss: float
    timestep: float | None
    reg: bool


@dataclass
class ImageScore:
    path: str
    score: float  # geometric mean of loss / (median loss at that timestep); 1.0 is typical
    samples: int
    mean_loss: float

    @property
    def flagged(self) -> bool:
        return self.score >= FLAG_RATIO


def read_samples(path: Path) -> list[Sample]:
    """Every finite per-sample loss in the file; lines that are half-written or malformed are skipped."""
    samples: list[Sample] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return samples
    for line in lines:
        try:
            record = json.loads(line)
            step, paths, losses = int(record["step"]), record["paths"], record["losses"]
            timesteps = record.get("timesteps") or [None] * len(paths)
            reg = record.get("reg") or [False] * len(paths)
        except (ValueError, KeyError, TypeError):
            continue
        for p, loss, t, r in zip(paths, losses, timesteps, reg):
            if isinstance(loss, (int, float)) and math.isfinite(loss) and loss >= 0:
                samples.append(Sample(step, str(p), float(loss), None if t is None else float(t), bool(r)))
    return samples


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def _late_half(samples: list[Sample]) -> list[Sample]:
    """Samples of the run's second half, when that half saw at least half of the images."""
    first, last = min(s.step for s in samples), max(s.step for s in samples)
    late = [s for s in samples if s.step > (first + last) / 2]
    return late if len({s.path for s in late}) * 2 >= len({s.path for s in samples}) else samples


def rank_images(samples: Iterable[Sample], include_reg: bool = False) -> list[ImageScore]:
    """Images from the hardest to fit to the easiest (see the module's docstring for the score)."""
    samples = [s for s in samples if include_reg or not s.reg]
    if not samples:
        return []
    samples = _late_half(samples)
    timed = all(s.timestep is not None for s in samples)
    ordered = sorted(samples, key=lambda s: s.timestep) if timed else samples
    bins = min(BINS, max(1, len(ordered) // 5)) if timed else 1
    bin_of = [i * bins // len(ordered) for i in range(len(ordered))]  # equal-count timestep bins
    groups: dict[int, list[float]] = {}
    for b, sample in zip(bin_of, ordered):
        groups.setdefault(b, []).append(sample.loss)
    medians = {b: max(_median(v), 1e-12) for b, v in groups.items()}
    ratios: dict[str, list[float]] = {}
    losses: dict[str, list[float]] = {}
    for b, sample in zip(bin_of, ordered):
        ratio = max(sample.loss, 1e-12) / medians[b]
        ratios.setdefault(sample.path, []).append(math.log(ratio))
        losses.setdefault(sample.path, []).append(sample.loss)
    scores = [ImageScore(path, math.exp(sum(r) / len(r)), len(r), sum(losses[path]) / len(losses[path]))
              for path, r in ratios.items()]
    return sorted(scores, key=lambda s: (-s.score, s.path))


def rank_run(run_dir: Path | str, include_reg: bool = False) -> list[ImageScore] | None:
    """The ranking of a run's images, None when the run recorded no per-image losses."""
    path = image_losses_path(run_dir)
    if not path.is_file():
        return None
    return rank_images(read_samples(path), include_reg)
