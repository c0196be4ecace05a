"""The shape of a guard: a small object with one job, called at fixed points of every step.

The loop calls, in order: `on_start` once (after resume); `max_grad_norm` before clipping (the smallest answer
is the step's clip threshold; None = no opinion); `on_out_of_memory` when the step's forward or backward ran out
of memory (no verdict from any guard: the error ends the run); `before_optimizer_step` after the backward pass
and clipping; `after_step` once the step is counted; `after_measuring` once the observers (validation loss,
diagnostics) have put their numbers into the step's metrics; `on_end` once the last step is done. Every hook
looks at a `GuardView` (a few read-only numbers and handles, never the session) and returns verdicts
(verdicts.py) that the loop carries out: a guard never changes the weights, the optimizer, the step counter or
the run folder itself, and keeps no live tensor of the run (a weight is named by its index in
`view.lora_layers`). A guard may add numbers to `metrics`. A guard's `state_dict` goes into every checkpoint, so a
resumed run continues with the same state.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

from ...lora.layers import LoraLayerView
from .verdicts import Verdict

Verdicts = Sequence[Verdict]


class GuardView(Protocol):
    """What a guard may look at. The loop's implementation reads the live session (session.SessionView)."""

    @property
    def step(self) -> int: ...  # optimizer steps taken (before_optimizer_step: the next step is step + 1)

    @property
    def max_steps(self) -> int: ...

    @property
    def lr(self) -> float: ...  # the first parameter group's current rate

    @property
    def micro_batch_size(self) -> int: ...

    @property
    def blocks_swapped(self) -> int: ...  # transformer blocks kept in CPU memory now (block swap)

    @property
    def blocks_swappable(self) -> int: ...  # how many could be (0: the family has none, or no checkpointing)

    @property
    def mixed_precision(self) -> str: ...  # what autocast runs in now: "no", "fp16" or "bf16"

    @property
    def scaler_active(self) -> bool: ...  # an fp16 GradScaler scales the loss

    @property
    def loss_scale(self) -> float | None: ...  # the GradScaler's scale (a device sync); None without one

    @property
    def lora_layers(self) -> Sequence[LoraLayerView]: ...  # every LoRA layer of the run, in a fixed order: read,
    # never kept (the loop resolves a verdict's layer indices)


class Guard:
    name = "guard"

    def on_start(self, view: GuardView) -> Verdicts:
        return ()

    def max_grad_norm(self, view: GuardView) -> float | None:
        return None

    def on_out_of_memory(self, view: GuardView, reason: str, tries: int) -> Verdicts:
        return ()

    def before_optimizer_step(self, view: GuardView, loss: float, grad_norm: float) -> Verdicts:
        return ()

    def after_step(self, view: GuardView, metrics: dict[str, Any]) -> Verdicts:
        return ()

    def after_measuring(self, view: GuardView, metrics: dict[str, Any]) -> Verdicts:
        return ()

    def on_end(self, view: GuardView) -> Verdicts:
        return ()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
