"""Learning-rate changes taken by guards, and the plateau mode (lr_scheduler=plateau, the seed's AdaLR).

Lowering the rate for good is the run's schedule's own job (train/schedule.py: a factor per parameter group,
saved with the schedule, so a resumed run keeps it); the guards only decide when and by how much.
"""
from __future__ import annotations

import math
from typing import Any

from .base import Guard


def scale_learning_rate(s: Any, factor: float, floor: float = 0.0) -> tuple[float, float]:
    """Multiply every group's peak rate by `factor` for the rest of the run, never below `floor`; returns the
    first group's (old, new) peak (the current rate is ~0 in a warm-up, the peak says what changed)."""
    return s.lr_scheduler.lower(factor, floor)


class PlateauGuard(Guard):
    """Lower the rate when validation loss stops improving: `patience` evaluations without a new best
    (by a relative margin of 1e-3) multiply it by `factor`, down to `min_lr`.

    Validation loss comes from the validation guard (diagnostics), which puts `val_loss` into the step's
    metrics on the steps it measures; this guard runs after it.
    """

    name = "plateau"

    def __init__(self, patience: int, factor: float, min_lr: float) -> None:
        self.patience, self.factor, self.min_lr = patience, factor, min_lr
        self.best = math.inf
        self.waited = 0
        self.reductions = 0

    def after_step(self, s: Any, metrics: dict[str, Any]) -> str | None:
        val = metrics.get("val_loss")
        if val is None or not math.isfinite(val):
            return None
        return self.observe(s, float(val))

    def observe(self, s: Any, val: float) -> None:
        if val < self.best * (1 - 1e-3):
            self.best, self.waited = val, 0
            return None
        self.waited += 1
        if self.waited < self.patience:
            return None
        self.waited = 0
        if s.optimizer.param_groups[0]["lr"] <= self.min_lr:
            return None
        old, new = scale_learning_rate(s, self.factor, self.min_lr)
        self.reductions += 1
        s.run.event("lr_plateau", f"Validation loss has not improved on {self.best:.4g} for {self.patience} "
                    f"evaluations; learning rate {old:.3g} -> {new:.3g}.", step=s.state.step, old_lr=old, new_lr=new)
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "waited": self.waited, "reductions": self.reductions}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = float(state.get("best", math.inf))
        self.waited = int(state.get("waited", 0))
        self.reductions = int(state.get("reductions", 0))
