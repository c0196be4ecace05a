"""Out-of-memory recovery: free, halve the micro-batch, try the same step again; at micro-batch 1 (or once the
halvings are spent), keep more transformer blocks in CPU memory (block swap, a quarter of them more each time; only
where the family has blocks and gradient checkpointing is on), which changes speed and no number. The base's storage
is never changed in the middle of a run.

The loop draws noise and timesteps per sampler batch before splitting it into micro-batches, so a smaller
micro-batch changes memory use and nothing else: the effective batch (and, up to float summation order,
the trajectory) stays. The random-number state is put back before the retry, so the retried step draws
exactly what the failed attempt drew. After `retries` halvings within one step, or at micro-batch 1, the
run saves a checkpoint and stops with advice.

With several processes, an OOM on one rank reaches every rank: the step's all-reduce carries an OOM flag and
all ranks raise together (step.forward_backward), so this guard takes the same decision everywhere and no rank
waits in a collective that another has left.
"""
from __future__ import annotations

import gc
from typing import Any

import torch

from .base import Guard, GuardView, Verdicts
from .verdicts import ShrinkMicroBatch, StopOutOfMemory, SwapMoreBlocks

ADVICE = ("lower resolution or max_bucket_reso, turn on gradient_checkpointing, use mixed_precision fp16/bf16, "
          "base_storage int8 or nf4, cache_latents, or a smaller lora_rank; then resume with --resume auto")


class OutOfMemoryStop(RuntimeError):
    """The step does not fit even after shrinking the micro-batch; the message says what to change."""


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class MemGuard(Guard):
    """Decides what an out-of-memory error in a step's forward/backward means; the loop retries the step
    (gradients freed, random-number state put back) or stops."""

    name = "memory"

    def __init__(self, retries: int = 3) -> None:
        self.retries = retries
        self.halvings = 0  # over the whole run, for the record
        self.swaps = 0

    def on_out_of_memory(self, view: GuardView, reason: str, tries: int) -> Verdicts:
        """`tries`: retries this step already had."""
        step, micro = view.step + 1, view.micro_batch_size
        swapped, swappable = view.blocks_swapped, view.blocks_swappable
        if (micro <= 1 or tries >= self.retries) and swapped < swappable:
            self.swaps += 1
            return (SwapMoreBlocks(step, swapped, min(swappable, swapped + max(1, swappable // 4)), reason),)
        if micro <= 1 or tries >= self.retries:
            message = (f"Out of memory at step {step} even with micro-batch {micro} ({reason}). To fit: {ADVICE}.")
            return (StopOutOfMemory(step, message),)
        self.halvings += 1
        return (ShrinkMicroBatch(step, micro, max(1, micro // 2), reason),)

    def state_dict(self) -> dict[str, Any]:
        return {"halvings": self.halvings, "swaps": self.swaps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.halvings = int(state.get("halvings", 0))
        self.swaps = int(state.get("swaps", 0))
