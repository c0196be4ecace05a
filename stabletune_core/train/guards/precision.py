"""fp16 that keeps overflowing falls back to bf16 (where the GPU has it) or fp32, instead of wasting the run.

The run's GradScaler (train/amp.py) already skips a step whose fp16 gradients overflow and halves its loss scale.
Occasional skips are normal; a scale collapsing below `SCALE_FLOOR`, or `max_skips` overflowing steps in a
row, means fp16 cannot represent this run. The guard then switches the frozen model to the fallback dtype,
drops the scaler and carries on; the switch is kept in the guard state, so a resumed run switches again.
Mixed precision is the engine's own object, not accelerate's, so the switch uses no private attributes.
"""
from __future__ import annotations

from typing import Any

import torch

from .base import Guard

SCALE_FLOOR = 2.0**-4


def should_fall_back(overflow_streak: int, scale: float, max_skips: int, floor: float = SCALE_FLOOR) -> bool:
    return overflow_streak >= max_skips or scale < floor


def fallback_precision() -> str:
    """'bf16' on a GPU that supports it, else 'no' (fp32)."""
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


def switch_precision(s: Any, precision: str) -> None:
    """Run the rest of the training in `precision` ('bf16' or 'no'): autocast follows and the scaler goes
    (s.amp), and the frozen model is recast. LoRA weights stay fp32 and are not touched."""
    s.amp.switch_to(precision)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    trained = {id(p) for p in s.params}
    for module in (s.bundle.unet, *s.bundle.text_encoders):
        for p in module.parameters():
            if id(p) not in trained and p.dtype != dtype:
                p.data = p.data.to(dtype)
        for b in module.buffers():
            if b.is_floating_point():
                b.data = b.data.to(dtype)
    s.weight_dtype = dtype


class PrecisionGuard(Guard):
    name = "precision"

    def __init__(self, max_skips: int = 8) -> None:
        self.max_skips = max_skips
        self.streak = 0
        self.switched_to: str | None = None

    def on_start(self, s: Any) -> None:
        if self.switched_to and s.amp.precision == "fp16":  # resumed after a fallback
            switch_precision(s, self.switched_to)
            s.run.event("precision", f"Continuing in {self.switched_to} as before the resume (fp16 overflowed).",
                        step=s.state.step)

    def before_optimizer_step(self, s: Any, loss: float, grad_norm: float) -> bool:
        if s.amp.loss_scale is not None:
            self.streak = self.streak + 1 if grad_norm != grad_norm or abs(grad_norm) == float("inf") else 0
        return True

    def after_step(self, s: Any, metrics: dict[str, Any]) -> str | None:
        scale = s.amp.loss_scale
        if scale is None:  # not fp16, or already fallen back
            return None
        metrics["loss_scale"] = scale
        if should_fall_back(self.streak, scale, self.max_skips):
            target = fallback_precision()
            switch_precision(s, target)
            self.switched_to = target
            s.run.event("precision", f"fp16 kept overflowing ({self.streak} skipped steps in a row, loss scale "
                        f"{scale:g}); continuing in {'bf16' if target == 'bf16' else 'fp32'}.", step=s.state.step,
                        precision=target)
            self.streak = 0
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self.streak, "switched_to": self.switched_to or ""}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak = int(state.get("streak", 0))
        self.switched_to = state.get("switched_to") or None
