"""Preflight: one training step at the largest bucket and one sampling pass, before any real training.

It answers "will this fit?" in seconds instead of an out-of-memory error an hour in: peak memory of a step
and of sampling, and (on a GPU) the largest micro-batch that fits at the largest bucket. On a CPU it reports
the process's peak resident memory and skips the search. Random-number state and gradients are put back,
so running it before training changes nothing in the run.
"""
from __future__ import annotations

import resource
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import TrainConfig
from ..data.examples import DatasetView, collate
from .guards.out_of_memory import free_memory
from .samples import Sampler
from .state import restore_rng, rng_state
from .step import StepParts, forward_backward
from .train_state import TrainState
from .validation_images import make_validation_images

MB = 2**20
MAX_SEARCH = 64

#: step(batches, micro_batch_size): the run's forward and backward (step.forward_backward, bound by `measure_run`)
Step = Callable[[list[dict[str, Any]], int], Any]


def measure_run(config: TrainConfig, data: DatasetView, state: TrainState, parts: StepParts, sampler: Sampler,
                optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`preflight` with this run's step (at its position in the data) and a two-step sampling of one image."""
    sampling = config.model_copy(update={"validation_prompt": config.validation_prompt or "preflight",
                                         "num_validation_images": 1, "validation_inference_steps": 2})
    return preflight(data, batch_size=config.train_batch_size, micro_batch_size=state.micro_batch_size,
                     with_pixels=parts.inputs.latent_cache is None, position=(state.epoch, state.batch_in_epoch),
                     step=lambda batches, micro: forward_backward(batches, parts, micro_batch_size=micro,
                                                                  step=state.step),
                     optimizer=optimizer, device=sampler.device,
                     render=lambda folder: make_validation_images(sampler.bundle, sampling, folder, sampler.device,
                                                                  autocast=sampler.autocast))


def largest_bucket_batch(data: DatasetView, size: int, *, with_pixels: bool, position: tuple[int, int]
                         ) -> tuple[dict[str, Any], tuple[int, int]]:
    """`size` examples of the largest-area bucket (repeating its images when it has fewer), drawing noise as the
    batch at `position` of the data order would."""
    buckets = data.item_buckets
    bucket = max(buckets, key=lambda b: (b[0] * b[1], b))
    indices = [i for i, b in enumerate(buckets) if b == bucket]
    chosen = [indices[k % len(indices)] for k in range(size)]
    batch = collate([data.example(i, 0, with_pixels=with_pixels) for i in chosen])
    batch["index"] = chosen
    batch["position"] = tuple(position)
    return batch, bucket


def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def preflight(data: DatasetView, *, batch_size: int, micro_batch_size: int, with_pixels: bool,
              position: tuple[int, int], step: Step, optimizer: torch.optim.Optimizer, device: torch.device,
              render: Callable[[Path], Any]) -> dict[str, Any]:
    """Measure one step and one sampling pass (`render(folder)` makes one validation image there); returns the
    report. Random-number state and gradients are put back."""
    rng = rng_state()
    report: dict[str, Any] = {"device": str(device)}

    def fits(micro: int) -> bool:
        batch, _ = largest_bucket_batch(data, micro, with_pixels=with_pixels, position=position)
        ok = True
        try:
            step([batch], micro)
        except torch.cuda.OutOfMemoryError:
            ok = False
        optimizer.zero_grad(set_to_none=True)
        free_memory(device)
        return ok

    try:
        batch, bucket = largest_bucket_batch(data, batch_size, with_pixels=with_pixels, position=position)
        report["largest_bucket"] = f"{bucket[0]}x{bucket[1]}"
        _reset_peak(device)
        start = time.perf_counter()
        step([batch], micro_batch_size)
        report["step_seconds"] = round(time.perf_counter() - start, 3)
        optimizer.zero_grad(set_to_none=True)
        report["step_peak_mb" if device.type == "cuda" else "peak_rss_mb"] = round(_peak_mb(device), 1)
        free_memory(device)
        if device.type == "cuda":
            largest, size = 0, 1
            while size <= MAX_SEARCH and fits(size):
                largest, size = size, size * 2
            report["largest_micro_batch"] = largest
        _reset_peak(device)
        with tempfile.TemporaryDirectory() as folder:
            render(Path(folder))
        report["sampling_peak_mb" if device.type == "cuda" else "peak_rss_mb_after_sampling"] = round(
            _peak_mb(device), 1)
    finally:
        optimizer.zero_grad(set_to_none=True)
        restore_rng(rng)
        free_memory(device)
    return report


def describe(report: dict[str, Any]) -> str:
    parts = [f"{k}={v}" for k, v in report.items()]
    return "Preflight: " + ", ".join(parts) + "."
