"""What a guard can ask the loop to do. A guard looks and returns verdicts; the loop carries them out
(`loop.carry_out`), because only the loop owns the weights, the optimizer, the step counter and the run folder.

Each verdict is a small frozen record of a decision and the facts behind it, so the loop can act on it and say
in events.jsonl why the run did what it did.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ...runs import events


@dataclass(frozen=True)
class Event:
    """One line of events.jsonl (and of the console when `console`)."""

    kind: str
    message: str
    console: bool = False
    fields: Mapping[str, Any] = field(default_factory=dict)


class Verdict:
    """Base of every decision a guard hands to the loop."""


@dataclass(frozen=True)
class Report(Verdict):
    """Nothing to change; write this event."""

    event: Event


@dataclass(frozen=True)
class SkipStep(Verdict):
    """Do not apply this step's update. `overflow`: fp16 gradients overflowed with a finite loss (the scaler's
    business, not a fault); otherwise `what` ("loss" or "gradients") was non-finite."""

    loss: float
    grad_norm: float
    overflow: bool = False
    what: str = "loss"

    def event(self, step: int, loss_scale: float | None, tensors: list[str], paths: list[str]) -> Event:
        """What the loop writes once it skipped optimizer step `step`: the fp16 loss scale after an overflow, else
        the non-finite gradient `tensors` and the step's images (`paths`)."""
        if self.overflow:
            return Event(events.FP16_OVERFLOW, f"Skipped step {step}: fp16 gradients overflowed; loss scale is now "
                         f"{loss_scale:g}.", fields=dict(step=step))
        detail = f" in {len(tensors)} gradient tensors, e.g. {', '.join(tensors[:3])}" if tensors else ""
        return Event(events.NONFINITE, f"Skipped step {step}: non-finite {self.what} (loss {self.loss}, grad norm "
                     f"{self.grad_norm}){detail}.",
                     fields=dict(step=step, what=self.what, tensors=tensors[:20], paths=paths))


@dataclass(frozen=True)
class TakeSnapshot(Verdict):
    """Keep an in-memory copy of the adapter weights and optimizer state to roll back to."""


@dataclass(frozen=True)
class RollBack(Verdict):
    """Put the adapter and optimizer back to the last snapshot (else the newest good checkpoint) and lower the
    learning rate by `lr_factor`, never below `min_lr`."""

    step: int
    bad_steps: tuple[int, ...]
    window: int
    lr_factor: float
    min_lr: float

    def event(self, source: str, old_lr: float, new_lr: float) -> Event:
        """What the loop writes once it rolled back (`source`: to what) and lowered the rate."""
        return Event(events.ROLLBACK, f"{len(self.bad_steps)} non-finite steps within {self.window} steps (last at "
                     f"step {self.step}): {source}; learning rate {old_lr:.3g} -> {new_lr:.3g}.", console=True,
                     fields=dict(step=self.step, old_lr=old_lr, new_lr=new_lr, bad_steps=list(self.bad_steps)))


@dataclass(frozen=True)
class ShrinkMicroBatch(Verdict):
    """Out of memory: retry the same step with micro-batch `new` (the effective batch stays)."""

    step: int
    old: int
    new: int
    reason: str

    def event(self, paths: list[str]) -> Event:
        """What the loop writes once it shrank the micro-batch (`paths`: the step's images)."""
        return Event(events.OOM, f"Out of memory at step {self.step} with micro-batch {self.old} ({self.reason}); "
                     f"retrying with micro-batch {self.new} and twice the accumulation, so the effective batch stays "
                     "the same.", console=True,
                     fields=dict(step=self.step, old_micro_batch=self.old, new_micro_batch=self.new, paths=paths))


@dataclass(frozen=True)
class SwapMoreBlocks(Verdict):
    """Out of memory at micro-batch 1: keep `new` transformer blocks in CPU memory instead of `old` and retry the
    step (block swap; the numbers stay the same, the step gets slower). The base's storage never changes mid-run."""

    step: int
    old: int
    new: int
    reason: str

    def event(self, blocks: list[int]) -> Event:
        """What the loop writes once it swapped more blocks (`blocks`: the ones it added)."""
        return Event(events.OOM, f"Out of memory at step {self.step} with micro-batch 1 ({self.reason}); retrying "
                     f"with {self.new} transformer blocks in CPU memory instead of {self.old} (block swap: slower, "
                     "the same numbers).", console=True,
                     fields=dict(step=self.step, old_blocks_swapped=self.old, new_blocks_swapped=self.new,
                                 blocks=blocks))


@dataclass(frozen=True)
class StopOutOfMemory(Verdict):
    """Out of memory even at the smallest micro-batch: save a checkpoint and fail with `message`."""

    step: int
    message: str


@dataclass(frozen=True)
class LowerLearningRate(Verdict):
    """Multiply every group's rate by `factor`, never below `floor`."""

    factor: float
    floor: float
    best: float  # the validation loss that has not been beaten
    patience: int

    def event(self, step: int, old_lr: float, new_lr: float) -> Event:
        """What the loop writes once it lowered the rate."""
        return Event(events.LR_PLATEAU, f"Validation loss has not improved on {self.best:.4g} for {self.patience} "
                     f"evaluations; learning rate {old_lr:.3g} -> {new_lr:.3g}.",
                     fields=dict(step=step, old_lr=old_lr, new_lr=new_lr))


@dataclass(frozen=True)
class SwitchPrecision(Verdict):
    """Run the rest of the training in `precision` ('bf16' or 'no'); `event` says why."""

    precision: str
    event: Event


@dataclass(frozen=True)
class ScaleWeights(Verdict):
    """Multiply both factors (down and up) of LoRA layer `layers[i]` (an index into `GuardView.lora_layers`) by
    `factors[i]`, in place (max-norm regularisation of the LoRA update)."""

    layers: tuple[int, ...]
    factors: tuple[float, ...]


@dataclass(frozen=True)
class SaveBest(Verdict):
    """Save a checkpoint at this step and keep it from pruning as the best."""

    reason: str = "best validation loss"


@dataclass(frozen=True)
class ProtectCheckpoint(Verdict):
    """The checkpoint of step `step` is the best one (from a resumed guard state): pruning must keep it."""

    step: int | None


@dataclass(frozen=True)
class StopDiverged(Verdict):
    """Training is not going anywhere (every step non-finite): fail the run with `message`."""

    message: str


@dataclass(frozen=True)
class ExportBest(Verdict):
    """Export the adapter of the best checkpoint as <output_name>_best next to the last one."""


@dataclass(frozen=True)
class StopEarly(Verdict):
    """Export the best adapter, then end the run as stopped."""

    step: int
    value: float
    factor: float
    window: int
    threshold: float
    triggers: int
    best_step: int
    best_value: float

    def event(self, best_lora: Path | None, best_checkpoint: Path | None) -> Event:
        return Event(events.EARLY_STOP,
                     f"Stopped early at step {self.step}: validation loss {self.value:.5f} was above "
                     f"{self.factor} x the upper quartile of its best {self.window} evaluations "
                     f"({self.threshold:.5f}) {self.triggers} times since its best "
                     f"{self.best_value:.5f} at step {self.best_step}. The best LoRA is "
                     f"{best_lora.name if best_lora else 'not exported'}; the last one is exported too.",
                     console=True,
                     fields=dict(step=self.step, best_step=self.best_step, best_val_loss=self.best_value,
                                 best_lora=str(best_lora) if best_lora else None,
                                 best_checkpoint=str(best_checkpoint) if best_checkpoint else None))
