"""What setup builds and the loop owns: the session (the run's fixed wiring) and the read-only view that guards get.

The session is frozen: no part of it (model, optimizer, caches, run writer) is swapped during a run. What changes
lives in `TrainState` (train_state.py), which only the loop writes. The parts the loop hands work to take small
frozen records of what they use, which the session gives as views of its parts: `StepParts` (step.py), `RunFiles`
(run_files.py), `Sampler` (samples.py); only setup and the loop hold the whole session.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from ..config import TrainConfig
from ..data.examples import DatasetView
from ..data.loader import BatchFeed
from ..data.order import BucketBatchSampler
from ..data.scan import DataItem
from ..lora.layers import LoraLayerView
from ..lora.pivotal import PivotalTokens
from ..models.base import ModelBundle, Objective
from ..runs.layout import RunPaths
from ..runs.writer import RunWriter
from .amp import MixedPrecision
from .checkpoint import nothing
from .ema import AdapterEMA
from .guards.base import Guard
from .inputs import BatchInputs
from .lr_schedule import LearningRateSchedule
from .noise import NoiseOptions
from .observers.base import Observer
from .perceptual import Perceptual
from .ranks import Ranks
from .run_files import RunFiles
from .samples import Sampler
from .step import StepParts
from .train_state import TrainState
from .observers.validation_loss import Evaluator


@dataclass(frozen=True)
class Session:
    """The run as setup wired it."""

    config: TrainConfig
    ranks: Ranks  # the processes: device, agreement, gradient sums, broadcasts (ranks.py)
    run: RunWriter
    bundle: ModelBundle
    objective: Objective  # the family's: timesteps, noising, target, loss weights, the denoiser call
    data: DatasetView
    sampler: BucketBatchSampler
    feed: BatchFeed  # the DataLoader the steps draw their batches from
    inputs: BatchInputs  # a batch's latents and conditioning (caches or encoders)
    optimizer: torch.optim.Optimizer
    lr_scheduler: LearningRateSchedule
    params: list[torch.nn.Parameter]
    trained: dict[str, torch.nn.Module]  # modules with adapters, by checkpoint prefix (accelerate-prepared)
    lora_layers: tuple[LoraLayerView, ...]  # their LoRA layers (lora/layers.py), in a fixed order
    amp: MixedPrecision  # autocast, the fp16 loss scaler and the frozen model's dtype (amp.py)
    max_steps: int
    state: TrainState
    guards: tuple[Guard, ...] = ()
    observers: tuple[Observer, ...] = ()
    validation_items: list[DataItem] = field(default_factory=list)  # images held out of training (validation_split)
    perceptual: Perceptual | None = None  # the LPIPS regulariser (perceptual.py) when perceptual_lambda > 0
    ema: AdapterEMA | None = None  # ema_decay > 0: the moving average of the adapter weights
    evaluator: Evaluator | None = None  # measures the model without changing it (validation loss, probes)
    preview: ModelBundle | None = None  # preview_model: validation images from this denoiser (preview.py)
    checkpoint_halfway: Callable[[int], None] = nothing  # test-only: the fault harness (faults.arm) sets it
    pivotal: PivotalTokens | None = None  # pivotal_tokens: the new tokens' trained embedding rows
    pivotal_freeze_step: int = 0  # from this step on the new token rows are frozen (embedding_train_fraction)

    @property
    def device(self) -> torch.device:
        return self.ranks.device

    @property
    def denoiser(self) -> torch.nn.Module:
        """The trained denoiser as the step calls it (accelerate's wrapper with several processes)."""
        return self.trained["unet"]

    # The records the loop's hands take: views of this session's parts, made when asked (a few microseconds), so
    # they can never disagree with it (a session copied with another part, e.g. perceptual=None, or a knob changed
    # on its config between steps, steps with what it now holds).
    @property
    def step_parts(self) -> StepParts:
        """What one step's forward and backward use (step.forward_backward)."""
        return StepParts(self.inputs, self.objective, self.denoiser, self.trained, self.params, self.amp, self.ranks,
                         NoiseOptions.from_config(self.config), self.config.masked_loss,
                         self.config.prior_loss_weight, self.perceptual)

    @property
    def files(self) -> RunFiles:
        """What checkpoints, the resume and the LoRA are written from and read back into (run_files.py)."""
        return RunFiles(self.config, self.run, self.ranks, self.trained, self.pivotal, self.optimizer,
                        self.lr_scheduler, self.amp, self.ema, (*self.guards, *self.observers), self.bundle, self.data,
                        self.max_steps, self.checkpoint_halfway)

    @property
    def samples(self) -> Sampler:
        """What validation images are made with (samples.py)."""
        return Sampler(self.config, self.run, self.ranks, self.bundle, self.preview, self.trained, self.pivotal,
                       self.optimizer, self.ema, self.device, self.amp.autocast, self.max_steps)


class SessionView:
    """The `GuardView` (guards/base.py) and `ObserverView` (observers/base.py) of a live session: read-only, read when
    asked."""

    __slots__ = ("_s", "_step")

    def __init__(self, session: Session, *, step: int | None = None) -> None:
        self._s = session
        self._step = step  # a sampling made after its step (deferred.py) is seen at the step it was taken

    @property
    def step(self) -> int:
        return self._s.state.step if self._step is None else self._step

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
    def blocks_swapped(self) -> int:
        swap = self._s.bundle.extra.get("block_swap")
        return len(swap.blocks) if swap is not None else 0

    @property
    def blocks_swappable(self) -> int:
        if not self._s.config.gradient_checkpointing:
            return 0
        return len(self._s.bundle.family.swappable_blocks(self._s.bundle.denoiser))

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
    def lora_layers(self) -> tuple[LoraLayerView, ...]:
        return self._s.lora_layers

    @property
    def adapters(self) -> Mapping[str, torch.nn.Module]:
        return {prefix: self._s.ranks.unwrap(m) for prefix, m in self._s.trained.items()}

    @property
    def run_paths(self) -> RunPaths | None:
        return self._s.run.paths if self._s.run.enabled else None
