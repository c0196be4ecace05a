"""The shape of a guard: a small object with one job, called at fixed points of every step.

The loop calls, in order: `on_start` once (after resume); `before_optimizer_step` after the backward pass and
clipping; `after_step` once the step is counted; `after_measuring` once the observers (validation loss,
diagnostics) have put their numbers into the step's metrics. Every hook looks at a `GuardView` (a few read-only
numbers, never the session) and returns verdicts (verdicts.py) that the loop carries out: a guard never
changes the weights, the optimizer, the step counter or the run folder itself. A guard may add numbers to
`metrics`. A guard's `state_dict` goes into every checkpoint, so a resumed run continues with the same state.
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

import torch

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
    def mixed_precision(self) -> str: ...  # what autocast runs in now: "no", "fp16" or "bf16"

    @property
    def scaler_active(self) -> bool: ...  # an fp16 GradScaler scales the loss

    @property
    def loss_scale(self) -> float | None: ...  # the GradScaler's scale (a device sync); None without one

    @property
    def adapters(self) -> Mapping[str, torch.nn.Module]: ...  # the modules carrying LoRA layers, unwrapped


class Guard:
    name = "guard"

    def on_start(self, view: GuardView) -> Verdicts:
        return ()

    def before_optimizer_step(self, view: GuardView, loss: float, grad_norm: float) -> Verdicts:
        return ()

    def after_step(self, view: GuardView, metrics: dict[str, Any]) -> Verdicts:
        return ()

    def after_measuring(self, view: GuardView, metrics: dict[str, Any]) -> Verdicts:
        return ()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
