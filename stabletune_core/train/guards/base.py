"""The shape of a guard: a small object with one job, called at fixed points of every step.

The loop calls, in order: `on_start` once (after resume), `before_optimizer_step` after the backward
pass and clipping (any guard returning False skips the optimizer step), and `after_step` once the step
is counted (a guard may add numbers to `metrics`, and may return "stop" to end the run cleanly). A
guard's `state_dict` goes into every checkpoint, so a resumed run continues with the same guard state.
Each decision a guard takes is written to events.jsonl with its reason.
"""
from __future__ import annotations

from typing import Any


class Guard:
    name = "guard"

    def on_start(self, s: Any) -> None:
        pass

    def before_optimizer_step(self, s: Any, loss: float, grad_norm: float) -> bool:
        return True

    def after_step(self, s: Any, metrics: dict[str, Any]) -> str | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
