"""The run's files the loop writes and reads back: checkpoints, the exported LoRA (and its EMA, the best one), the
resume. The loop decides when; these functions do it, with the parts they use (`RunFiles`), never the session.

They never change the step counter. A checkpoint that cannot be written (a full disk) is one console line and the run
goes on (`save`, which counts the failures in the run's TrainState); CHECKPOINT_FAILURE_LIMIT of them in a row end
the run with a sentence (RunFailed).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..config import TrainConfig
from ..data.examples import DatasetView
from ..lora.export import read_lora_metadata
from ..lora.inject import adapter_settings
from ..lora.pivotal import PivotalTokens
from ..models.base import ModelBundle
from ..runs import events, states
from ..runs.layout import best_name, ema_name, set_aside_name
from ..runs.writer import RunWriter
from .amp import MixedPrecision
from .checkpoint import (CheckpointError, list_checkpoints, load_checkpoint, nothing, prune_checkpoints,
                         save_checkpoint)
from .ema import AdapterEMA
from .lora_output import write_lora
from .lr_schedule import LearningRateSchedule
from .optim import evaluation_weights
from .outcome import RunFailed
from .ranks import Ranks
from .state import Keeper, adapter_state, restore_adapter, restore_run_state, run_state
from .train_state import TrainState


@dataclass(frozen=True)
class RunFiles:
    """What a checkpoint and a LoRA are written from and read back into (the loop builds it from the session)."""

    config: TrainConfig
    run: RunWriter
    ranks: Ranks
    trained: dict[str, torch.nn.Module]
    pivotal: PivotalTokens | None
    optimizer: torch.optim.Optimizer
    lr_scheduler: LearningRateSchedule
    amp: MixedPrecision
    ema: AdapterEMA | None
    keepers: Sequence[Keeper]  # the guards and observers whose state a checkpoint keeps
    bundle: ModelBundle
    data: DatasetView
    max_steps: int
    halfway: Callable[[int], None] = nothing  # test-only: the fault harness's hook inside the checkpoint writer

    def adapter(self) -> dict[str, torch.Tensor]:
        return adapter_state(self.trained, self.ranks, self.pivotal)


CHECKPOINT_FAILURE_LIMIT = 3  # checkpoints in a row that may fail (a full disk) before the run stops


# ---- checkpoints --------------------------------------------------------------------------------------------------
def save(files: RunFiles, state: TrainState, reason: str) -> Path | None:
    """Write a checkpoint (every process waits for the main one, which alone writes). A failed one (a full disk) is
    one console line and the run goes on, keeping the last good checkpoint; CHECKPOINT_FAILURE_LIMIT failures in a
    row stop the run with a sentence."""
    files.ranks.wait()
    if not files.ranks.is_main:
        return None
    files.run.status(states.SAVING, step=state.step)
    try:
        folder = write_checkpoint(files, state, reason)
    except CheckpointError as exc:
        state.checkpoint_failures += 1
        files.run.event(events.CHECKPOINT_FAILED, str(exc), step=state.step, console=True)
        if state.checkpoint_failures >= CHECKPOINT_FAILURE_LIMIT:
            raise RunFailed(f"Stopped at step {state.step} because {state.checkpoint_failures} checkpoints in a row "
                            f"could not be written ({exc.reason or exc}); "
                            f"{last_good_sentence(files.run.paths.checkpoints)}") from None
        files.run.status(states.TRAINING, step=state.step, max_steps=files.max_steps, error=str(exc))
        return None
    state.checkpoint_failures = 0
    return folder


def write_checkpoint(files: RunFiles, state: TrainState, reason: str) -> Path:
    """RUN/checkpoints/step_NNNNNN of the run as it is now, then the older ones past checkpoints_total_limit pruned
    (never the best one). Main process only; raises CheckpointError (a full disk) with the older ones kept."""
    saved = run_state(state, files.optimizer, files.lr_scheduler, files.amp, files.ema, files.keepers,
                      adapter_settings(files.config))
    folder = save_checkpoint(files.run.paths.checkpoint(state.step), state.step, files.adapter(), saved,
                             halfway=files.halfway)
    protect = {state.best_checkpoint} if state.best_checkpoint else set()
    removed = prune_checkpoints(files.run.paths.checkpoints, files.config.checkpoints_total_limit, protect=protect)
    files.run.event(events.CHECKPOINT, f"Saved checkpoint at step {state.step} ({reason}).", step=state.step,
                    path=str(folder), removed=[str(p) for p in removed])
    return folder


def last_good_sentence(checkpoints: Path) -> str:
    """What to do after checkpoints failed, naming the last good one (lower case: it ends a sentence)."""
    folders = list_checkpoints(checkpoints)
    if not folders:
        return "free some space and start the run again (it has no checkpoint yet)."
    return f"free some space and continue with --resume auto from the last good checkpoint, {folders[-1].name}."


def resume(files: RunFiles, state: TrainState) -> None:
    """Put the checkpoint setup found (and verified before the model loaded) back into the run; nothing when there
    is none. Its tensors are let go of once loaded."""
    checkpoint, state.resume_from = state.resume_from, None
    if checkpoint is None:
        return
    restore_adapter(files.trained, files.ranks, checkpoint.adapter, files.pivotal)
    ema_kept = restore_run_state(checkpoint.state, state, files.optimizer, files.lr_scheduler, files.amp, files.ema,
                                 files.keepers)
    if not ema_kept:
        files.run.event(events.CONFIG, f"{checkpoint.path.name} holds no EMA weights (ema_decay was 0 then); the EMA "
                        f"starts from the resumed weights at step {state.step}.", step=state.step, console=True)
    files.run.event(events.RESUMED_FROM_CHECKPOINT, f"Resumed from {checkpoint.path} at step {state.step} "
                    f"({state.images_seen} images seen, micro-batch {state.micro_batch_size}).", step=state.step,
                    path=str(checkpoint.path), images_seen=state.images_seen)


# ---- the LoRA -----------------------------------------------------------------------------------------------------
def export(files: RunFiles, name: str, *, step: int, epoch: int) -> Path | None:
    """The LoRA as trained, and with ema_decay its moving average beside it as NAME-ema.safetensors. `step`: the
    step the weights come from (the file's ss_steps). Without an EMA, an EMA file an earlier part of the run wrote
    (resumed with ema_decay 0) is set aside under the step it is from, so it never looks like this LoRA's."""
    where = dict(step=step, epoch=epoch, max_steps=files.max_steps, config=files.config, ranks=files.ranks,
                 run=files.run, bundle=files.bundle, trained=files.trained, data=files.data, pivotal=files.pivotal)
    with evaluation_weights(files.optimizer):  # schedule-free: export the averaged weights, not the training point
        path = write_lora(name, **where)
    if files.ema:
        with files.ema.swapped_in():
            write_lora(ema_name(name), **where)
    elif path is not None:
        set_aside_earlier_ema(files.run, name, step)
    return path


def set_aside_earlier_ema(run: RunWriter, name: str, step: int) -> Path | None:
    """RUN/output/NAME-ema.safetensors (and NAME-ema_diffusers/) left by the steps before a resume without EMA:
    renamed to NAME-ema_stepNNNNNN (the step its ss_steps names), never deleted; one console line says so."""
    stale = run.paths.lora(ema_name(name))
    if not stale.is_file():
        return None
    try:
        from_step = int(read_lora_metadata(stale).get("ss_steps", ""))
    except (ValueError, OSError):  # not a file we wrote (no ss_steps, or unreadable): say so in its new name
        from_step = None
    aside = free_name(run.paths.lora(set_aside_name(ema_name(name), from_step)))
    stale.rename(aside)
    moved = [aside]
    folder = run.paths.diffusers_lora(ema_name(name))
    if folder.is_dir():
        moved.append(free_name(run.paths.diffusers_lora(set_aside_name(ema_name(name), from_step))))
        folder.rename(moved[-1])
    when = f"step {from_step}" if from_step is not None else "an earlier part of the run"
    run.event(events.EXPORTED, f"{stale.name} is the moving average of {when}, not of this LoRA (this run has no "
              f"EMA, ema_decay 0): renamed it {aside.name}.", step=step, console=True,
              paths=[str(p) for p in moved])
    return aside


def free_name(path: Path) -> Path:
    """`path`, or PATH-2, PATH-3, ... when a file of that name is there already (nothing is overwritten)."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return candidate


def export_best(files: RunFiles, best_checkpoint: Path, *, epoch: int) -> Path | None:
    """Export the best checkpoint as <output_name>_best, then put the current state back.

    Everything the export reads comes from the best step: the adapter, the EMA beside it (`_best-ema` is the
    average *at* the best step, not the one of the last step) and the optimizer state (a schedule-free
    optimizer's evaluation weights are computed from it)."""
    best = load_checkpoint(best_checkpoint)
    current = files.adapter()
    current_optimizer = files.optimizer.state_dict()  # load_state_dict replaces these tensors, it does not write them
    current_ema = files.ema.state_dict() if files.ema else None
    try:
        restore_adapter(files.trained, files.ranks, best.adapter, files.pivotal)
        files.optimizer.load_state_dict(best.state["optimizer"])
        if files.ema and best.state.get("ema"):
            files.ema.load_state_dict(best.state["ema"])
        return export(files, best_name(files.config.output_name), step=best.step, epoch=epoch)  # ss_steps: its step
    finally:
        restore_adapter(files.trained, files.ranks, current, files.pivotal)
        files.optimizer.load_state_dict(current_optimizer)
        if current_ema is not None:
            files.ema.load_state_dict(current_ema)
