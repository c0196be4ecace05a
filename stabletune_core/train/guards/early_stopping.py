"""Early stopping on the deterministic validation loss, keeping the best checkpoint and exporting the best LoRA.

The rule: the reference window is the `window` lowest validation losses seen so far (the best region of the
curve). An evaluation *triggers* when it is above `factor` x the window's upper quartile. After `patience`
triggers since the last new best, and once `min_steps` are done, the run stops. A window that follows the
latest values instead would rise along with a slowly overfitting curve and never fire; anchored to the best
region, the rule reads "the loss is now clearly above where it was at its best", while a single noisy
evaluation is absorbed by the patience.

On every new best the guard asks the loop to save a resumable checkpoint of that step, which pruning keeps (the
guard remembers the step; the loop knows where its checkpoint is). When the run ends (stopped here, or finished)
it asks the loop to export the best adapter as `<output_name>_best.safetensors` next to the last one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...config import TrainConfig
from ...runs import events
from .base import Guard, GuardView, Verdicts
from .verdicts import Event, ExportBest, ProtectCheckpoint, Report, SaveBest, StopEarly, Verdict


@dataclass
class Judgement:
    stop: bool
    triggered: bool
    threshold: float | None  # factor x upper quartile of the reference window; None while it is not full
    best_step: int
    best_value: float
    triggers: int


def upper_quartile(values: list[float]) -> float:
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), 0.75))


def judge(history: list[tuple[int, float]], *, window: int, factor: float, patience: int, min_steps: int
          ) -> Judgement:
    """Apply the rule to a whole (step, value) history; pure, so it is easy to test and to resume."""
    best_step, best_value = min(history, key=lambda sv: (sv[1], sv[0]))
    best_index = max(i for i, (step, _) in enumerate(history) if step == best_step)
    triggers, threshold, triggered = 0, None, False
    for i in range(best_index + 1, len(history)):
        seen = sorted(v for _, v in history[:i])
        if len(seen) < window:
            continue
        threshold = factor * upper_quartile(seen[:window])
        triggered = history[i][1] > threshold
        triggers += triggered
    if best_index == len(history) - 1:
        triggered = False
    stop = triggers >= patience and history[-1][0] >= min_steps
    return Judgement(stop, triggered, threshold, best_step, best_value, triggers)


class EarlyStoppingGuard(Guard):
    """Reads `val_loss` from the step's metrics (the validation observer puts it there)."""

    name = "early_stopping"

    def __init__(self, config: TrainConfig) -> None:
        self.window = config.early_stopping_window
        self.factor = config.early_stopping_factor
        self.patience = config.early_stopping_patience
        self.min_steps = config.early_stopping_min_steps
        self.history: list[tuple[int, float]] = []
        self.best_step: int | None = None  # the step whose checkpoint is the best (saved when it was measured)

    def on_start(self, view: GuardView) -> Verdicts:
        return (ProtectCheckpoint(self.best_step),)

    def after_measuring(self, view: GuardView, metrics: dict[str, Any]) -> Verdicts:
        value = metrics.get("val_loss")
        step = view.step
        verdicts: list[Verdict] = []
        if value is not None:
            self.history.append((step, float(value)))
            judgement = judge(self.history, window=self.window, factor=self.factor, patience=self.patience,
                              min_steps=self.min_steps)
            if judgement.best_step == step:
                self.best_step = step
                verdicts.append(SaveBest())
            elif judgement.triggered:
                verdicts.append(Report(Event(
                    events.EARLY_STOPPING_TRIGGER,
                    f"Validation loss {value:.5f} at step {step} is above {self.factor} x the upper "
                    f"quartile of its best {self.window} evaluations ({judgement.threshold:.5f}); trigger "
                    f"{judgement.triggers} of {self.patience} since the best ({judgement.best_value:.5f} at "
                    f"step {judgement.best_step}).",
                    fields=dict(step=step, val_loss=value, threshold=judgement.threshold,
                                triggers=judgement.triggers))))
            if judgement.stop:
                verdicts.append(StopEarly(step, value, self.factor, self.window, judgement.threshold,
                                          judgement.triggers, judgement.best_step, judgement.best_value))
                return verdicts
        if step >= view.max_steps and self.best_step is not None:
            verdicts.append(ExportBest())
        return verdicts

    def state_dict(self) -> dict[str, Any]:
        return {"history": [[step, value] for step, value in self.history], "best_step": self.best_step or 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = [(int(step), float(value)) for step, value in state.get("history", [])]
        self.best_step = int(state["best_step"]) if state.get("best_step") else None
