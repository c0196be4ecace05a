"""Out-of-memory recovery: free, halve the micro-batch, try the same step again.

The loop draws noise and timesteps per sampler batch before splitting it into micro-batches, so a smaller
micro-batch changes memory use and nothing else: the effective batch (and, up to float summation order,
the trajectory) stays. The random-number state is put back before the retry, so the retried step draws
exactly what the failed attempt drew. After `retries` halvings within one step, or at micro-batch 1, the
run saves a checkpoint and stops with advice.

With several processes, an OOM on one rank reaches every rank: the step's all-reduce carries an OOM flag and
all ranks raise together (loop.forward_backward), so this guard takes the same decision everywhere and no rank
waits in a collective that another has left.
"""
from __future__ import annotations

import gc
from typing import Any, Callable

import torch

from .base import Guard

ADVICE = ("lower resolution or max_bucket_reso, turn on gradient_checkpointing, use mixed_precision fp16/bf16, "
          "cache_latents, or a smaller lora_rank; then resume with --resume auto")


class OutOfMemoryStop(RuntimeError):
    """The step does not fit even after shrinking the micro-batch; the message says what to change."""


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class MemGuard(Guard):
    name = "memory"

    def __init__(self, retries: int = 3) -> None:
        self.retries = retries
        self.halvings = 0  # over the whole run, for the record

    def run(self, s: Any, step_fn: Callable[[], float]) -> float:
        """`step_fn()` (forward and backward of one step), retried with half the micro-batch on CUDA OOM."""
        from ..loop import restore_rng, rng_state

        rng = rng_state(s)
        tries = 0
        while True:
            try:
                return step_fn()
            except torch.cuda.OutOfMemoryError as exc:
                reason = str(exc).splitlines()[0] if str(exc) else "CUDA out of memory"
            # Out of the except block: the traceback, and the activations its frames hold, are gone.
            s.optimizer.zero_grad(set_to_none=True)
            free_memory(s.device)
            restore_rng(s, rng)
            step, micro = s.state.step + 1, s.state.micro_batch_size
            if micro <= 1 or tries >= self.retries:
                self.stop(s, step, micro, reason)
            tries += 1
            self.halvings += 1
            s.state.micro_batch_size = max(1, micro // 2)
            s.run.event("oom", f"Out of memory at step {step} with micro-batch {micro} ({reason}); retrying with "
                        f"micro-batch {s.state.micro_batch_size} and twice the accumulation, so the effective batch "
                        "stays the same.", step=step, old_micro_batch=micro,
                        new_micro_batch=s.state.micro_batch_size, paths=list(s.batch_paths), console=True)

    def stop(self, s: Any, step: int, micro: int, reason: str) -> None:
        from ..loop import save

        message = (f"Out of memory at step {step} even with micro-batch {micro} ({reason}). To fit: {ADVICE}.")
        s.run.event("oom_stop", message, step=step)
        save(s, "out of memory")
        s.run.status("failed", step=s.state.step, error=message)
        raise OutOfMemoryStop(message)

    def state_dict(self) -> dict[str, Any]:
        return {"halvings": self.halvings}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.halvings = int(state.get("halvings", 0))
