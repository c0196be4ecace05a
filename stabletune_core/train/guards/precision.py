"""fp16 that keeps overflowing falls back to bf16 (where the GPU has it) or fp32, instead of wasting the run.

The run's GradScaler (train/amp.py) already skips a step whose fp16 gradients overflow and halves its loss scale.
Occasional skips are normal; a scale collapsing below `SCALE_FLOOR`, or `max_skips` overflowing steps in a
row, means fp16 cannot represent this run. The guard then asks for the fallback precision (`SwitchPrecision`);
the loop recasts the frozen model and drops the scaler. The switch is kept in the guard state, so a resumed run
asks again.
"""
from __future__ import annotations

from typing import Any

import torch

from ...runs import events
from .base import Guard, GuardView, Verdicts
from .verdicts import Event, SwitchPrecision

SCALE_FLOOR = 2.0**-4


def should_fall_back(overflow_streak: int, scale: float, max_skips: int, floor: float = SCALE_FLOOR) -> bool:
    return overflow_streak >= max_skips or scale < floor


def fallback_precision() -> str:
    """'bf16' on a GPU that supports it, else 'no' (fp32)."""
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


class PrecisionGuard(Guard):
    name = "precision"

    def __init__(self, max_skips: int = 8) -> None:
        self.max_skips = max_skips
        self.streak = 0
        self.switched_to: str | None = None

    def on_start(self, view: GuardView) -> Verdicts:
        if self.switched_to and view.mixed_precision == "fp16":  # resumed after a fallback
            return (SwitchPrecision(self.switched_to, Event(
                events.PRECISION, f"Continuing in {self.switched_to} as before the resume (fp16 overflowed).",
                fields={"step": view.step})),)
        return ()

    def before_optimizer_step(self, view: GuardView, loss: float, grad_norm: float) -> Verdicts:
        if view.scaler_active:
            self.streak = self.streak + 1 if grad_norm != grad_norm or abs(grad_norm) == float("inf") else 0
        return ()

    def after_step(self, view: GuardView, metrics: dict[str, Any]) -> Verdicts:
        if not view.scaler_active:
            return ()
        scale = float(view.loss_scale)
        metrics["loss_scale"] = scale
        if not should_fall_back(self.streak, scale, self.max_skips):
            return ()
        target = fallback_precision()
        event = Event(events.PRECISION, f"fp16 kept overflowing ({self.streak} skipped steps in a row, loss scale "
                      f"{scale:g}); continuing in {'bf16' if target == 'bf16' else 'fp32'}.",
                      fields={"step": view.step, "precision": target})
        self.switched_to = target
        self.streak = 0
        return (SwitchPrecision(target, event),)

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self.streak, "switched_to": self.switched_to or ""}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak = int(state.get("streak", 0))
        self.switched_to = state.get("switched_to") or None
