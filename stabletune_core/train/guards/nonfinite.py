"""Never let a NaN or Inf reach the weights.

Before each optimizer step the loss and the total gradient norm are checked; a non-finite one skips the
step. When `max_bad` steps within `window` steps are bad, the run is diverging rather than unlucky: the LoRA
weights and optimizer state go back to the last good snapshot (kept in memory every `window` clean steps;
the newest good checkpoint when there is none) and the learning rate is lowered by `lr_factor`.

With fp16 and a GradScaler, an infinite gradient with a finite loss is the scaler probing its scale, not a
fault: the step is skipped and the scaler told (so the scale drops), but it does not count towards a
rollback; the precision guard watches those.
"""
from __future__ import annotations

import math
from typing import Any

from ...config import TrainConfig
from .base import Guard, GuardView, Verdicts
from .verdicts import RollBack, SkipStep, StopDiverged, TakeSnapshot, Verdict


class NonFiniteGuard(Guard):
    name = "nonfinite"

    def __init__(self, window: int = 20, max_bad: int = 3, lr_factor: float = 0.5, min_lr: float = 0.0, *,
                 config: TrainConfig | None = None) -> None:
        self.window, self.max_bad, self.lr_factor, self.min_lr = window, max_bad, lr_factor, min_lr
        self.config = config  # what the advice of a hopeless run names (rate, alpha, rank, precision)
        self.bad_steps: list[int] = []
        self.skipped = 0
        self.rollbacks = 0
        self.steps = 0  # optimizer steps this process tried
        self.good_steps = 0  # of them, with finite loss and gradients
        self.bad_in_a_row = 0  # non-finite steps since the last good one

    @classmethod
    def from_config(cls, config: TrainConfig) -> "NonFiniteGuard":
        return cls(config.nan_window, config.nan_max_bad, config.nan_lr_factor, config.min_lr, config=config)

    def on_start(self, view: GuardView) -> Verdicts:
        return (TakeSnapshot(),)

    def before_optimizer_step(self, view: GuardView, loss: float, grad_norm: float) -> Verdicts:
        self.steps += 1
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.good_steps += 1
            self.bad_in_a_row = 0
            return ()
        step = view.step + 1
        self.skipped += 1
        if view.scaler_active and math.isfinite(loss):
            # the scaler lowers its scale; the precision guard watches those
            return (SkipStep(loss, grad_norm, overflow=True),)
        self.bad_in_a_row += 1
        verdicts: list[Verdict] = [SkipStep(loss, grad_norm, what="loss" if not math.isfinite(loss) else "gradients")]
        self.bad_steps = [b for b in self.bad_steps if b > step - self.window] + [step]
        if len(self.bad_steps) >= self.max_bad:
            self.rollbacks += 1
            verdicts.append(RollBack(step, tuple(self.bad_steps), self.window, self.lr_factor, self.min_lr))
            self.bad_steps = []
        return verdicts

    def after_step(self, view: GuardView, metrics: dict[str, Any]) -> Verdicts:
        step = view.step
        if self.bad_in_a_row >= max(4 * self.max_bad, 8):  # several rollbacks and lower rates did not help
            return (StopDiverged(self.diverged(view.lr)),)
        if step % self.window == 0 and not any(b > step - self.window for b in self.bad_steps):
            return (TakeSnapshot(),)
        return ()

    def on_end(self, view: GuardView) -> Verdicts:
        """A run in which no step was finite has nothing to keep."""
        if self.steps and self.good_steps == 0 and self.bad_in_a_row > 0:
            return (StopDiverged(self.diverged(view.lr)),)
        return ()

    def diverged(self, lr: float) -> str:
        what = (f"all {self.steps} training steps" if self.good_steps == 0 else
                f"the last {self.bad_in_a_row} training steps (after {self.rollbacks} rollbacks)")
        kept = "so no LoRA was written" if self.good_steps == 0 else "so the run stopped (the last good checkpoint " \
            "is kept)"
        advice = f"lower learning_rate (now {lr:.3g})"
        config = self.config
        if config is not None:
            precision = " or train in bf16 or without mixed precision instead of fp16" if \
                config.mixed_precision == "fp16" else ""
            advice = (f"lower learning_rate (set {config.learning_rate:g}, now {lr:.3g}) or lora_alpha (now "
                      f"{config.effective_lora_alpha:g} with rank {config.lora_rank}){precision}")
        return f"Training diverged: {what} had a non-finite loss or gradient (NaN/Inf), {kept}; {advice}."

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "rollbacks": self.rollbacks, "bad_steps": list(self.bad_steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped = int(state.get("skipped", 0))
        self.rollbacks = int(state.get("rollbacks", 0))
        self.bad_steps = [int(b) for b in state.get("bad_steps", [])]
