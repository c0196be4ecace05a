"""The run's learning rate: a schedule's shape (warm-up, cosine, ...) times factors that guards lower for good.

diffusers' schedules are torch LambdaLR objects: each step they set a group's rate to its configured rate times
the shape at that step. Lowering the rate for good (a plateau, a rollback after non-finite steps) must survive
every later step and a resume, without rewriting the scheduler's own state. So the schedule is left alone and
`LearningRateSchedule` multiplies each group's rate by a factor of its own, kept in its state_dict beside the
schedule's; a resumed run therefore continues with exactly the same rates.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.optim.lr_scheduler import LRScheduler


class LearningRateSchedule:
    """Wraps the LRScheduler that `build(optimizer)` makes; used by the loop as that scheduler (step,
    get_last_lr, state_dict, load_state_dict) and by the guards through `lower` and `peak_lrs`."""

    def __init__(self, optimizer: torch.optim.Optimizer, build: Callable[[torch.optim.Optimizer], LRScheduler]
                 ) -> None:
        self.optimizer = optimizer
        # The configured rates, read before the schedule sets the first step's (0 in a warm-up from zero).
        self.configured_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self.schedule = build(optimizer)
        self.factors = [1.0] * len(self.configured_lrs)  # 1 until a guard lowers the rate for good
        self._apply()

    def _apply(self) -> None:
        for group, lr, factor in zip(self.optimizer.param_groups, self.schedule.get_last_lr(), self.factors):
            group["lr"] = lr * factor

    def step(self) -> None:
        # Hand the schedule its own last rates first: a chainable scheduler computes from the group's current
        # rate, which would otherwise compound the factor at every step.
        for group, lr in zip(self.optimizer.param_groups, self.schedule.get_last_lr()):
            group["lr"] = lr
        self.schedule.step()
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [lr * factor for lr, factor in zip(self.schedule.get_last_lr(), self.factors)]

    def peak_lrs(self) -> list[float]:
        """Each group's rate where the shape is 1 (after the warm-up): what a lowering is measured on."""
        return [lr * factor for lr, factor in zip(self.configured_lrs, self.factors)]

    def lower(self, factor: float, floor: float = 0.0) -> tuple[float, float]:
        """Multiply every group's peak rate by `factor` for the rest of the run, never below `floor` (a peak
        already below it stays); the current rates follow at once. Returns the first group's (old, new) peak."""
        old = self.peak_lrs()
        for i, peak in enumerate(old):
            if self.configured_lrs[i] > 0:
                self.factors[i] = max(peak * factor, min(floor, peak)) / self.configured_lrs[i]
        self._apply()
        return old[0], self.peak_lrs()[0]

    def state_dict(self) -> dict[str, Any]:
        return {"schedule": self.schedule.state_dict(), "factors": list(self.factors)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the schedule and the factors. A checkpoint from before this class holds the bare scheduler's
        state, whose lowered rates are inside it (torch restores them): it loads with factors of 1."""
        if "factors" in state:
            self.schedule.load_state_dict(state["schedule"])
            self.factors = [float(f) for f in state["factors"]]
        else:
            self.schedule.load_state_dict(state)
            self.factors = [1.0] * len(self.configured_lrs)
            # Those runs also lowered each group's "initial_lr" (restored with the optimizer, which the loop loads
            # first): the peaks that later lowerings start from.
            self.configured_lrs = [float(group.get("initial_lr", lr))
                                   for group, lr in zip(self.optimizer.param_groups, self.configured_lrs)]
        self._apply()
