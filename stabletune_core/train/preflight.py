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
from typing import Any

import torch

from ..data.dataset import collate
from .guards.memory import free_memory
from .sampling import make_validation_images
from .session import Session
from .state import restore_rng, rng_state
from .step import forward_backward

MB = 2**20
MAX_SEARCH = 64


def largest_bucket_batch(s: Session, size: int) -> tuple[dict[str, Any], tuple[int, int]]:
    """`size` examples of the largest-area bucket (repeating its images when it has fewer)."""
    buckets = s.data.item_buckets
    bucket = max(buckets, key=lambda b: (b[0] * b[1], b))
    indices = [i for i, b in enumerate(buckets) if b == bucket]
    chosen = [indices[k % len(indices)] for k in range(size)]
    batch = collate([s.data.example(i, 0, with_pixels=s.latent_cache is None) for i in chosen])
    batch["index"] = chosen
    return batch, bucket


def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _fits(s: Session, micro: int) -> bool:
    batch, _ = largest_bucket_batch(s, micro)
    s.state.micro_batch_size = micro
    ok = True
    try:
        forward_backward(s, [batch])
    except torch.cuda.OutOfMemoryError:
        ok = False
    s.optimizer.zero_grad(set_to_none=True)
    free_memory(s.device)
    return ok


def preflight(s: Session) -> dict[str, Any]:
    """Measure one step and one sampling pass; returns the report (also written as a 'preflight' event)."""
    rng, micro = rng_state(s), s.state.micro_batch_size
    device = s.device
    report: dict[str, Any] = {"device": str(device)}
    try:
        batch, bucket = largest_bucket_batch(s, s.config.train_batch_size)
        report["largest_bucket"] = f"{bucket[0]}x{bucket[1]}"
        _reset_peak(device)
        start = time.perf_counter()
        forward_backward(s, [batch])
        report["step_seconds"] = round(time.perf_counter() - start, 3)
        s.optimizer.zero_grad(set_to_none=True)
        report["step_peak_mb" if device.type == "cuda" else "peak_rss_mb"] = round(_peak_mb(device), 1)
        free_memory(device)
        if device.type == "cuda":
            fits, size = 0, 1
            while size <= MAX_SEARCH and _fits(s, size):
                fits, size = size, size * 2
            report["largest_micro_batch"] = fits
        _reset_peak(device)
        config = s.config.model_copy(update={"validation_prompt": s.config.validation_prompt or "preflight",
                                             "num_validation_images": 1, "validation_inference_steps": 2})
        with tempfile.TemporaryDirectory() as folder:
            make_validation_images(s.bundle, config, Path(folder), device, autocast=s.amp.autocast)
        report["sampling_peak_mb" if device.type == "cuda" else "peak_rss_mb_after_sampling"] = round(
            _peak_mb(device), 1)
    finally:
        s.optimizer.zero_grad(set_to_none=True)
        s.state.micro_batch_size = micro
        restore_rng(s, rng)
        free_memory(device)
    return report


def describe(report: dict[str, Any]) -> str:
    parts = [f"{k}={v}" for k, v in report.items()]
    return "Preflight: " + ", ".join(parts) + "."


def apply_preflight(s: Session) -> dict[str, Any]:
    """Run the preflight inside a training run; on a GPU start at the largest micro-batch that fits."""
    report = preflight(s)
    largest = report.get("largest_micro_batch")
    if largest is not None and 0 < largest < s.state.micro_batch_size:
        report["micro_batch_size"] = s.state.micro_batch_size = largest
    s.run.event("preflight", describe(report), step=s.state.step, **report)
    return report
