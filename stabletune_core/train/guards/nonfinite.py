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

import copy
import math
from typing import Any

import torch

from .base import Guard
from .lr import scale_learning_rate


class NonFiniteGuard(Guard):
    name = "nonfinite"

    def __init__(self, window: int = 20, max_bad: int = 3, lr_factor: float = 0.5, min_lr: float = 0.0) -> None:
        self.window, self.max_bad, self.lr_factor, self.min_lr = window, max_bad, lr_factor, min_lr
        self.bad_steps: list[int] = []
        self.skipped = 0
        self.rollbacks = 0
        self.snapshot: dict[str, Any] | None = None  # memory only; a resumed run starts from its checkpoint
        self.good_steps = 0  # optimizer steps this process took with finite loss and gradients
        self.bad_in_a_row = 0  # non-finite steps since the last good one

    def on_start(self, s: Any) -> None:
        self.take_snapshot(s)

    def before_optimizer_step(self, s: Any, loss: float, grad_norm: float) -> bool:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.good_steps += 1
            self.bad_in_a_row = 0
            return True
        step = s.state.step + 1
        self.skipped += 1
        if s.amp.loss_scale is not None:
            s.amp.skip()  # the skipped optimizer step would have done it: lower the loss scale
            if math.isfinite(loss):
                s.run.event("fp16_overflow", f"Skipped step {step}: fp16 gradients overflowed; loss scale is now "
                            f"{s.amp.loss_scale:g}.", step=step)
                return False
        self.bad_in_a_row += 1
        what = "loss" if not math.isfinite(loss) else "gradients"
        tensors = nonfinite_gradients(s)
        detail = f" in {len(tensors)} gradient tensors, e.g. {', '.join(tensors[:3])}" if tensors else ""
        s.run.event("nonfinite", f"Skipped step {step}: non-finite {what} (loss {loss}, grad norm {grad_norm})"
                    f"{detail}.", step=step, what=what, tensors=tensors[:20], paths=list(s.batch_paths))
        self.bad_steps = [b for b in self.bad_steps if b > step - self.window] + [step]
        if len(self.bad_steps) >= self.max_bad:
            self.rollback(s, step)
            self.bad_steps = []
        return False

    def after_step(self, s: Any, metrics: dict[str, Any]) -> str | None:
        step = s.state.step
        if step % self.window == 0 and not any(b > step - self.window for b in self.bad_steps):
            self.take_snapshot(s)
        return None

    # ---- snapshots and rollback ----------------------------------------------------------------------
    def take_snapshot(self, s: Any) -> None:
        with torch.no_grad():
            if not all(bool(torch.isfinite(p).all()) for p in s.params):
                return
            self.snapshot = {"step": s.state.step, "params": [p.detach().clone() for p in s.params],
                             "optimizer": copy.deepcopy(s.optimizer.state_dict())}

    def rollback(self, s: Any, step: int) -> None:
        source = self.restore(s)
        old, new = scale_learning_rate(s, self.lr_factor, self.min_lr)  # peaks: the current rate is ~0 in warm-up
        self.rollbacks += 1
        s.run.event("rollback", f"{len(self.bad_steps)} non-finite steps within {self.window} steps (last at step "
                    f"{step}): {source}; learning rate {old:.3g} -> {new:.3g}.", step=step, old_lr=old, new_lr=new,
                    bad_steps=list(self.bad_steps), console=True)

    # ---- a run that cannot be saved by rollbacks ---------------------------------------------------------
    def hopeless(self, steps: int, *, end: bool = False) -> bool:
        """True when training is not going anywhere: at the end of a run in which no step was finite, or when
        `4 x max_bad` steps in a row were non-finite (several rollbacks and lower rates did not help)."""
        if end:
            return steps > 0 and self.good_steps == 0 and self.bad_in_a_row > 0
        return self.bad_in_a_row >= max(4 * self.max_bad, 8)

    def hopeless_sentence(self, s: Any, steps: int) -> str:
        config = s.config
        lr = s.optimizer.param_groups[0]["lr"]
        what = (f"all {steps} training steps" if self.good_steps == 0 else
                f"the last {self.bad_in_a_row} training steps (after {self.rollbacks} rollbacks)")
        precision = " or train in bf16 or without mixed precision instead of fp16" if \
            config.mixed_precision == "fp16" else ""
        kept = "so no LoRA was written" if self.good_steps == 0 else "so the run stopped (the last good checkpoint " \
            "is kept)"
        return (f"Training diverged: {what} had a non-finite loss or gradient (NaN/Inf), {kept}; lower learning_rate "
                f"(set {config.learning_rate:g}, now {lr:.3g}) or lora_alpha (now {config.effective_lora_alpha:g} "
                f"with rank {config.lora_rank}){precision}.")

    def restore(self, s: Any) -> str:
        if self.snapshot is not None:
            with torch.no_grad():
                for p, saved in zip(s.params, self.snapshot["params"]):
                    p.copy_(saved)
            s.optimizer.load_state_dict(copy.deepcopy(self.snapshot["optimizer"]))
            return f"rolled the LoRA and optimizer back to step {self.snapshot['step']} (in memory)"
        from ..checkpoint import latest_good_checkpoint
        from ..loop import restore_adapter

        checkpoint = latest_good_checkpoint(s.run.paths.checkpoints)
        if checkpoint is None:
            return "no good state to roll back to (no snapshot, no checkpoint), kept the current weights"
        restore_adapter(s, checkpoint.adapter)
        s.optimizer.load_state_dict(checkpoint.state["optimizer"])
        return f"rolled the LoRA and optimizer back to checkpoint {checkpoint.path.name}"

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "rollbacks": self.rollbacks, "bad_steps": list(self.bad_steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped = int(state.get("skipped", 0))
        self.rollbacks = int(state.get("rollbacks", 0))
        self.bad_steps = [int(b) for b in state.get("bad_steps", [])]


def nonfinite_gradients(s: Any) -> list[str]:
    """Names of the trained tensors whose gradient holds NaN or Inf (only computed on a bad step)."""
    names = []
    for prefix, module in s.trained.items():
        for name, p in module.named_parameters():
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                names.append(f"{prefix}.{name}")
    return names
