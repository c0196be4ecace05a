"""Gradient clipping: a fixed max norm, or adaptive (a percentile of recent gradient norms).

Adaptive clipping follows the run's own scale: a spike far above the recent norms is cut to the chosen
percentile of the last `window` finite norms, while ordinary steps pass untouched. Until 10 norms are
known it does not clip (except at max_grad_norm, which stays a ceiling in every mode when it is > 0).
The history is saved with each checkpoint so a resumed run clips exactly as the uninterrupted one. The guard
owns the threshold (`max_grad_norm`, a pure function of its history); the loop clips to it and logs it.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

from .base import Guard, GuardView, Verdicts

MIN_HISTORY = 10


class ClipGuard(Guard):
    name = "clipping"

    def __init__(self, mode: str = "fixed", max_norm: float = 1.0, percentile: float = 95.0, window: int = 100):
        self.mode, self.max_norm, self.percentile = mode, max_norm, percentile
        self.norms: deque[float] = deque(maxlen=window)
        self.clipped = 0

    def threshold(self) -> float:
        """The max norm for the next step (inf = no clipping), from the norms seen so far."""
        ceiling = self.max_norm if self.max_norm > 0 and self.mode != "off" else math.inf
        if self.mode == "adaptive" and len(self.norms) >= MIN_HISTORY:
            ceiling = min(ceiling, float(np.percentile(np.fromiter(self.norms, float), self.percentile)))
        return ceiling

    def max_grad_norm(self, view: GuardView) -> float | None:
        return self.threshold()

    def before_optimizer_step(self, view: GuardView, loss: float, grad_norm: float) -> Verdicts:
        if math.isfinite(grad_norm):
            if grad_norm > self.threshold():  # the threshold this step was clipped to
                self.clipped += 1
            self.norms.append(grad_norm)  # the norm before clipping: the run's own scale
        return ()

    def state_dict(self) -> dict[str, Any]:
        return {"norms": list(self.norms), "clipped": self.clipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.norms.clear()
        self.norms.extend(float(n) for n in state.get("norms", []))
        self.clipped = int(state.get("clipped", 0))
