"""What setup builds and the loop owns: the session, its counters, and the read-only view guards get."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from accelerate import Accelerator

from ..config import TrainConfig
from ..data.dataset import BatchFeed, BucketBatchSampler, DatasetView, EmbeddingCache, LatentCache
from ..data.scan import DataItem
from ..models.base import ModelBundle, Objective
from ..runs.writer import RunWriter
from .amp import MixedPrecision
from .checkpoint import Checkpoint, nothing
from .ema import AdapterEMA
from .guards.base import Guard
from .loss import LossParts
from .observers import Observer
from .perceptual import Perceptual
from .schedule import LearningRateSchedule
from .tensorboard import TensorBoardLog


@dataclass
class TrainState:
    """Counters that a checkpoint must restore for a run to continue exactly."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batch_in_epoch: int = 0  # sampler batches of `epoch` already consumed
    images_seen: int = 0
    micro_batch_size: int = 0  # may shrink after an out-of-memory error; the effective batch never does

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


@dataclass
class Snapshot:
    """An in-memory copy of the adapter and optimizer state, for a rollback after non-finite steps."""

    step: int
    params: list[torch.Tensor]
    optimizer: dict[str, Any]


@dataclass
class Session:
    """What setup builds and every part of the step uses."""

    config: TrainConfig
    accelerator: Accelerator
    run: RunWriter
    bundle: ModelBundle
    objective: Objective  # the family's: timesteps, noising, target, loss weights, the denoiser call
    data: DatasetView
    sampler: BucketBatchSampler
    optimizer: torch.optim.Optimizer
    lr_scheduler: LearningRateSchedule
    params: list[torch.nn.Parameter]
    trained: dict[str, torch.nn.Module]  # modules with adapters, by checkpoint prefix
    state: TrainState
    max_steps: int
    generator: torch.Generator  # noise and timesteps
    weight_dtype: torch.dtype
    amp: MixedPrecision  # autocast and the fp16 loss scaler (amp.py), not accelerate's
    latent_cache: LatentCache | None = None
    text_cache: EmbeddingCache | None = None
    guards: list[Guard] = field(default_factory=list)
    observers: list[Observer] = field(default_factory=list)
    batch_paths: list[str] = field(default_factory=list)  # images of the current step, for the guards' events
    best_checkpoint: Path | None = None  # the best one (early stopping); pruning always keeps it
    snapshot: Snapshot | None = None  # the last in-memory good state (non-finite guard); never saved
    validation_items: list[DataItem] = field(default_factory=list)  # images held out of training (validation_split)
    perceptual: Perceptual | None = None  # the LPIPS regulariser (perceptual.py) when perceptual_lambda > 0
    sample_scores: dict[str, dict[str, float]] = field(default_factory=dict)  # sample_judge: first and last
    tensorboard: TensorBoardLog | None = None  # report_to=tensorboard: an observer of the logged metrics and samples
    feed: BatchFeed | None = None  # the DataLoader that next_batches draws from (made at its first call)
    resume_from: Checkpoint | None = None  # the checkpoint setup found to resume from (read before any model loaded)
    checkpoint_failures: int = 0  # checkpoints in a row that could not be written (a full disk)
    checkpoint_halfway: Callable[[int], None] = nothing  # test-only: the fault harness (faults.arm) sets it
    ema: AdapterEMA | None = None  # ema_decay > 0: the moving average of the adapter weights
    loss_parts: LossParts = field(default_factory=LossParts)  # this step's instance / prior loss (reg_data_dir)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def guard(self, name: str) -> Guard | Observer | None:
        """The guard or observer called `name`, if this run has one."""
        return next((g for g in [*self.guards, *self.observers] if g.name == name), None)


class SessionView:
    """The `GuardView` (guards/base.py) of a live session: read-only, read when asked."""

    __slots__ = ("_s",)

    def __init__(self, session: Session) -> None:
        self._s = session

    @property
    def step(self) -> int:
        return self._s.state.step

    @property
    def max_steps(self) -> int:
        return self._s.max_steps

    @property
    def lr(self) -> float:
        return self._s.optimizer.param_groups[0]["lr"]

    @property
    def micro_batch_size(self) -> int:
        return self._s.state.micro_batch_size

    @property
    def mixed_precision(self) -> str:
        return self._s.amp.precision

    @property
    def scaler_active(self) -> bool:
        return self._s.amp.scaler is not None

    @property
    def loss_scale(self) -> float | None:
        return self._s.amp.loss_scale

    @property
    def adapters(self) -> Mapping[str, torch.nn.Module]:
        return {prefix: self._s.accelerator.unwrap_model(m) for prefix, m in self._s.trained.items()}
