"""Early stopping on the deterministic validation loss, keeping the best checkpoint and exporting the best LoRA.

The rule: the reference window is the `window` lowest validation losses seen so far (the best region of the
curve). An evaluation *triggers* when it is above `factor` x the window's upper quartile. After `patience`
triggers since the last new best, and once `min_steps` are done, the run stops. A window that follows the
latest values instead would rise along with a slowly overfitting curve and never fire; anchored to the best
region, the rule reads "the loss is now clearly above where it was at its best", while a single noisy
evaluation is absorbed by the patience.

On every new best the guard saves a resumable checkpoint and remembers it as `s.best_checkpoint`, which
pruning keeps. When the run ends (stopped here, or finished) the best adapter is exported as
`<output_name>_best.safetensors` next to the last one.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import TrainConfig
from .guards.base import Guard


@dataclass
class Verdict:
    stop: bool
    triggered: bool
    threshold: float | None  # factor x upper quartile of the reference window; None while it is not full
    best_step: int
    best_value: float
    triggers: int


def upper_quartile(values: list[float]) -> float:
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), 0.75))


def judge(history: list[tuple[int, float]], *, window: int, factor: float, patience: int, min_steps: int
          ) -> Verdict:
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
    return Verdict(stop, triggered, threshold, best_step, best_value, triggers)


class EarlyStoppingGuard(Guard):
    """Reads `val_loss` from the step's metrics (the validation guard, earlier in the list, puts it there)."""

    name = "early_stopping"

    def __init__(self, config: TrainConfig) -> None:
        self.window = config.early_stopping_window
        self.factor = config.early_stopping_factor
        self.patience = config.early_stopping_patience
        self.min_steps = config.early_stopping_min_steps
        self.history: list[tuple[int, float]] = []
        self.best_checkpoint: str | None = None
        self.best_step: int | None = None

    def on_start(self, s: Any) -> None:
        s.best_checkpoint = Path(self.best_checkpoint) if self.best_checkpoint else None

    def after_step(self, s: Any, metrics: dict[str, Any]) -> str | None:
        value = metrics.get("val_loss")
        if value is not None:
            self.history.append((s.state.step, float(value)))
            verdict = judge(self.history, window=self.window, factor=self.factor, patience=self.patience,
                            min_steps=self.min_steps)
            if verdict.best_step == s.state.step:
                self.keep_best(s)
            elif verdict.triggered:
                s.run.event("early_stopping_trigger",
                            f"Validation loss {value:.5f} at step {s.state.step} is above {self.factor} x the upper "
                            f"quartile of its best {self.window} evaluations ({verdict.threshold:.5f}); trigger "
                            f"{verdict.triggers} of {self.patience} since the best ({verdict.best_value:.5f} at "
                            f"step {verdict.best_step}).", step=s.state.step, val_loss=value,
                            threshold=verdict.threshold, triggers=verdict.triggers)
            if verdict.stop:
                best = self.export_best(s)
                s.run.event("early_stop",
                            f"Stopped early at step {s.state.step}: validation loss {value:.5f} was above "
                            f"{self.factor} x the upper quartile of its best {self.window} evaluations "
                            f"({verdict.threshold:.5f}) {verdict.triggers} times since its best "
                            f"{verdict.best_value:.5f} at step {verdict.best_step}. The best LoRA is "
                            f"{best.name if best else 'not exported'}; the last one is exported too.",
                            step=s.state.step, best_step=verdict.best_step, best_val_loss=verdict.best_value,
                            best_lora=str(best) if best else None, console=True,
                            best_checkpoint=str(s.best_checkpoint) if s.best_checkpoint else None)
                return "stop"
        if s.state.step >= s.max_steps and self.best_step is not None:
            self.export_best(s)
        return None

    def keep_best(self, s: Any) -> None:
        from .loop import save

        self.best_step = s.state.step
        save(s, "best validation loss")  # every process: save() waits for all of them
        folder = s.run.paths.checkpoint(s.state.step)
        self.best_checkpoint = str(folder)
        s.best_checkpoint = folder

    def export_best(self, s: Any) -> Path | None:
        """Export the adapter of the best checkpoint as <output_name>_best, then put the current one back."""
        from .checkpoint import load_checkpoint
        from .loop import export
        from ..lora.inject import load_lora_state_dict, lora_state_dict

        if not self.best_checkpoint:
            return None
        best = load_checkpoint(Path(self.best_checkpoint))
        current = {prefix: lora_state_dict(s.accelerator.unwrap_model(m)) for prefix, m in s.trained.items()}
        by_prefix: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in best.adapter.items():
            prefix, name = key.split(".", 1)
            by_prefix.setdefault(prefix, {})[name] = value
        step = s.state.step
        try:
            for prefix, module in s.trained.items():
                load_lora_state_dict(s.accelerator.unwrap_model(module), by_prefix.get(prefix, {}))
            s.state.step = best.step  # the file's metadata (ss_steps) names the step it comes from
            return export(s, f"{s.config.output_name}_best")
        finally:
            s.state.step = step
            for prefix, module in s.trained.items():
                load_lora_state_dict(s.accelerator.unwrap_model(module), current[prefix])

    def state_dict(self) -> dict[str, Any]:
        return {"history": [[step, value] for step, value in self.history],
                "best_checkpoint": self.best_checkpoint or "", "best_step": self.best_step or 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = [(int(step), float(value)) for step, value in state.get("history", [])]
        self.best_checkpoint = state.get("best_checkpoint") or None
        self.best_step = int(state["best_step"]) if state.get("best_step") else None
