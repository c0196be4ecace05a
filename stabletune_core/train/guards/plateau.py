"""Learning-rate changes taken by guards, and the plateau mode (lr_scheduler=plateau, the seed's AdaLR).

Lowering the rate for good is the run's schedule's own job (train/lr_schedule.py: a factor per parameter group,
saved with the schedule, so a resumed run keeps it); the guards only decide when and by how much.
"""
from __future__ import annotations

import math
from typing import Any

from .base import Guard, GuardView, Verdicts
from .verdicts import LowerLearningRate


class PlateauGuard(Guard):
    """Lower the rate when validation loss stops improving: `patience` evaluations without a new best
    (by a relative margin of 1e-3) multiply it by `factor`, down to `min_lr`.

    Validation loss comes from the validation observer (validation_loss.py), which puts `val_loss` into the step's
    metrics on the steps it measures; this guard reads it after the observers ran.
    """

    name = "plateau"

    def __init__(self, patience: int, factor: float, min_lr: float) -> None:
        self.patience, self.factor, self.min_lr = patience, factor, min_lr
        self.best = math.inf
        self.waited = 0
        self.reductions = 0

    def after_measuring(self, view: GuardView, metrics: dict[str, Any]) -> Verdicts:
        val = metrics.get("val_loss")
        if val is None or not math.isfinite(val):
            return ()
        return self.observe(view, float(val))

    def observe(self, view: GuardView, val: float) -> Verdicts:
        if val < self.best * (1 - 1e-3):
            self.best, self.waited = val, 0
            return ()
        self.waited += 1
        if self.waited < self.patience:
            return ()
        self.waited = 0
        if view.lr <= self.min_lr:
            return ()
        self.reductions += 1
        return (LowerLearningRate(self.factor, self.min_lr, best=self.best, patience=self.patience),)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "waited": self.waited, "reductions": self.reductions}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = float(state.get("best", math.inf))
        self.waited = int(state.get("waited", 0))
        self.reductions = int(state.get("reductions", 0))
