"""Never let a NaN or Inf reach the weights: check loss and gradient norm before the optimizer step."""
from __future__ import annotations

import math
from typing import Any

from .base import Guard


class NonFiniteGuard(Guard):
    name = "nonfinite"

    def __init__(self) -> None:
        self.skipped = 0

    def before_optimizer_step(self, s: Any, loss: float, grad_norm: float) -> bool:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return True
        self.skipped += 1
        what = "loss" if not math.isfinite(loss) else "gradients"
        s.run.event("nonfinite", f"Skipped step {s.state.step + 1}: non-finite {what} (loss {loss}, grad norm "
                    f"{grad_norm}).", step=s.state.step + 1, what=what, paths=[str(p) for p in s.batch_paths])
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped = int(state.get("skipped", 0))
