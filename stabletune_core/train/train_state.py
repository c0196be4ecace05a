"""What changes while training (`TrainState`): the counters a checkpoint saves and what the loop keeps between
steps. Only the loop writes it; the parts it hands off (step.py, run_files.py, samples.py) read and move it as an
explicit argument. Its own module so that those parts need not import the session that holds them."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from .checkpoint import Checkpoint
from .deferred import DeferredSampling
from .rollback import Snapshot

#: The counters a checkpoint saves (its "train" entry): with them a resumed run continues exactly.
COUNTERS = ("step", "epoch", "batch_in_epoch", "images_seen", "micro_batch_size")


@dataclass
class TrainState:
    """Everything that changes while training. Only the loop writes it."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batch_in_epoch: int = 0  # sampler batches of `epoch` already consumed
    images_seen: int = 0
    micro_batch_size: int = 0  # may shrink after an out-of-memory error; the effective batch never does
    # ---- never saved -------------------------------------------------------------------------------------------
    resume_from: Checkpoint | None = None  # the checkpoint setup found to resume from (read before any model loaded)
    batch_paths: list[str] = field(default_factory=list)  # images of the current step, for the guards' events
    best_checkpoint: Path | None = None  # the best one (early stopping); pruning always keeps it
    snapshot: Snapshot | None = None  # the last in-memory good state (non-finite guard)
    checkpoint_failures: int = 0  # checkpoints in a row that could not be written (a full disk)
    deferred: DeferredSampling | None = None  # the step-0 images, made one per step while training runs

    def counters(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in COUNTERS}

    def restore_counters(self, saved: Mapping[str, int]) -> None:
        for name in COUNTERS:
            setattr(self, name, int(saved[name]))
