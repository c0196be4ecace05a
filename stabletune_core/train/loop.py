"""The training loop. Read it top to bottom: set up, resume, then one optimizer step at a time.

One step is `training_step` below with two helpers from step.py: `forward_backward` (the family's objective noises
the batch, the denoiser predicts, the loss goes backward over micro-batches; it takes the run's `StepParts`) and
`clip_gradients`. Everything that makes a run survive (non-finite losses, out-of-memory, clipping, early stopping)
lives in guard objects (guards/) called at fixed points of the step; a guard returns verdicts and `carry_out`,
below, acts on them, in one place, because only the loop owns the weights, the optimizer, the step counter and the
run folder. Observers (observers/) measure and record; everything the world should know goes to the run directory
through `RunWriter`. The loop decides when; its hands take small frozen records the session gives, never the
session: run_files.py (checkpoints, the LoRA, the resume: `RunFiles`), samples.py (validation images, deferred ones:
`Sampler`), control.py (the UI's commands), preflight.py. Nothing imports this module but the entry points (cli.py).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import torch

from ..config import TrainConfig
from ..runs import events, states
from . import run_files, signals, step
from .control import obey_control as obey
from .guards import Guard, OutOfMemoryStop
from .guards.out_of_memory import free_memory
from .guards.verdicts import (Event, ExportBest, LowerLearningRate, ProtectCheckpoint, Report, RollBack, SaveBest,
                              ScaleWeights, ShrinkMicroBatch, SkipStep, StopDiverged, StopEarly, StopOutOfMemory,
                              SwapMoreBlocks, SwitchPrecision, TakeSnapshot, Verdict)
from .memory_stats import memory_stats
from .placement import swap_more_blocks
from .observers.base import Observation
from .outcome import RunFailed
from .preflight import describe, measure_run
from .preview import preview_adapters
from .progress import HEARTBEAT_SECONDS, Pace  # noqa: F401  (HEARTBEAT_SECONDS: the loop's pace, tests read it here)
from .rollback import roll_back, take_snapshot
from .samples import (Sampling, announce, defer, end_deferred, more_deferred, owed_base_images, sampling_due,
                      take_samples)
from .session import Session, SessionView
from .setup import setup
from .state import restore_adapter, restore_rng, rng_state


# ---- the loop ------------------------------------------------------------------------------------------
def train(config: TrainConfig, *, session: Session | None = None) -> Path | None:
    """Train a LoRA as `config` says and return the exported file (None on non-main processes).

    Ends `finished`, or `stopped` (the UI, early stopping, Ctrl-C / SIGTERM) after a last checkpoint and the LoRA;
    a run that cannot go on raises (RunFailed and friends) and the CLI records it as `failed` (train/outcome.py).
    """
    s = session or setup(config)
    resume(s)
    run, state, view = s.run, s.state, SessionView(s)
    if s.config.preflight:
        apply_preflight(s)
    if s.config.validation_prompts and not s.ranks.from_main(signals.requested()) and s.ranks.is_main:
        # made a few images at a time from the next step on: training starts at once
        state.deferred = defer(s.samples, 0) if state.step == 0 else owed_base_images(s.samples, state.step)
    run.status(states.TRAINING, step=state.step, max_steps=s.max_steps)
    pace = Pace(state.step, s.max_steps, shown=s.ranks.is_main)
    stop_reason = states.FINISHED
    first_step = state.step
    for module in s.trained.values():
        module.train()
    for guard in s.guards:
        carry_out(s, guard, guard.on_start(view))
    try:  # the progress bar ends its line whatever happens, so a failure sentence starts on its own
        while state.step < s.max_steps:
            if signals.stop_asked(s.ranks, run, state.step):
                stop_reason = states.STOPPED
                break
            step.freeze_embeddings(s.pivotal, run, state.step, s.pivotal_freeze_step,
                                   s.config.embedding_train_fraction)
            batches = step.next_batches(s.feed, state, s.config.gradient_accumulation_steps)
            state.batch_paths = [str(p) for b in batches for p in b["path"]]
            loss, grad_norm, clip_threshold = training_step(s, batches)
            state.step += 1
            if loss.per_image is not None:
                run.image_losses(loss.per_image.record(state.step))
            state.images_seen += s.ranks.total(sum(len(b["caption"]) for b in batches))

            sec_per_step = pace.step_done()
            metrics = dict(loss=loss.mean, lr=s.lr_scheduler.get_last_lr()[0], grad_norm=grad_norm,
                           clip_threshold=clip_threshold, epoch=state.epoch, images_seen=state.images_seen,
                           sec_per_step=sec_per_step, micro_batch_size=state.micro_batch_size)
            if s.config.reg_data_dir:
                metrics.update(loss.parts)
            guard_stops = after_step(s, metrics)
            if state.step % s.config.logging_steps == 0 or state.step == s.max_steps:
                logged = {**metrics, **memory_stats(s.device)}
                run.metric(state.step, **logged)
                for observer in s.observers:
                    record(s, observer.on_metrics(view, logged))
            if pace.heartbeat_due(last_step=state.step == s.max_steps):
                run.status(states.TRAINING, step=state.step, max_steps=s.max_steps, epoch=state.epoch,
                           sec_per_step=sec_per_step, eta_seconds=sec_per_step * (s.max_steps - state.step),
                           loss=loss.mean)
            pace.show(loss.mean)
            if s.config.validation_prompts and sampling_due(state.step, s.config.validation_steps, s.max_steps):
                sample(s)
            if state.step % s.config.save_steps == 0 and state.step < s.max_steps:
                save(s, "every save_steps")
            if state.deferred is not None and state.step % state.deferred.every == 0:
                more_deferred(s.samples, state, 1, lambda sampling: samples_made(s, sampling))
            if guard_stops or obey_control(s):
                stop_reason = states.STOPPED
                break
    finally:
        pace.close()
    for guard in s.guards:
        carry_out(s, guard, guard.on_end(view))
    if state.step == first_step and stop_reason == states.STOPPED:  # stopped before any step: nothing new to keep
        run.status(states.STOPPED, step=state.step, max_steps=s.max_steps, eta_seconds=0)
        run.event(events.STOPPED, f"Run stopped at step {state.step} before training a step; nothing new to save.",
                  step=state.step, console=True)
        return None
    if state.deferred is not None and not end_deferred(s.samples, state, lambda sampling: samples_made(s, sampling),
                                                       make_the_rest=stop_reason == states.FINISHED):
        stop_reason = states.STOPPED  # main process only, which alone writes the outcome; every process saves alike
    save(s, stop_reason)
    final_checkpoint_failed = state.checkpoint_failures > 0
    path = export(s)
    ended = [observer.on_end(view) for observer in s.observers]
    if final_checkpoint_failed:
        written = f"the LoRA was written to {path}" if path else "the LoRA was not written"
        raise RunFailed(f"The final checkpoint at step {state.step} could not be written ({written}); "
                        f"{run_files.last_good_sentence(s.run.paths.checkpoints)}")
    for observation in ended:  # the summaries before the outcome: a run's last event is how it ended
        record(s, observation)
    summary = next((o.summary for o in ended if o.summary), None)
    run.status(stop_reason, step=state.step, max_steps=s.max_steps, eta_seconds=0, lora=str(path) if path else None,
               summary=summary)
    run.event(stop_reason, f"Run {stop_reason} at step {state.step}.", step=state.step,
              console=stop_reason == states.STOPPED)
    return path


# ---- one step -----------------------------------------------------------------------------------------
def training_step(s: Session, batches: list[dict[str, Any]]) -> tuple[step.StepLoss, float, float | None]:
    """Forward, backward, clip, ask the guards, optimizer step. Returns (loss, gradient norm before clipping,
    the clip threshold; None when nothing clipped)."""
    view = SessionView(s)
    loss = forward_backward_fitting(s, batches)
    max_norm = min((n for guard in s.guards if (n := guard.max_grad_norm(view)) is not None), default=math.inf)
    grad_norm = step.clip_gradients(s.params, s.optimizer, s.amp, max_norm)
    skip = False
    for guard in s.guards:
        verdicts = guard.before_optimizer_step(view, loss.mean, grad_norm)
        skip |= any(isinstance(v, (SkipStep, RollBack)) for v in verdicts)
        carry_out(s, guard, verdicts)
    if not skip:
        s.amp.step(s.optimizer)
        if s.ema:
            s.ema.update()
    s.lr_scheduler.step()
    s.optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm, max_norm if math.isfinite(max_norm) else None


def forward_backward(s: Session, batches: list[dict[str, Any]], *, micro_batch_size: int | None = None
                     ) -> step.StepLoss:
    """`step.forward_backward` with this run's parts (the micro-batch: the state's unless given)."""
    return step.forward_backward(batches, s.step_parts, micro_batch_size=micro_batch_size or s.state.micro_batch_size,
                                 step=s.state.step)


def forward_backward_fitting(s: Session, batches: list[dict[str, Any]]) -> step.StepLoss:
    """`forward_backward`; an out-of-memory error frees the step's memory, puts the random-number state back (the
    retry draws exactly what the failed attempt drew) and asks the guards; without a verdict it ends the run."""
    rng = rng_state()
    tries = 0
    while True:
        try:
            return forward_backward(s, batches)
        except torch.cuda.OutOfMemoryError as exc:
            reason = str(exc).splitlines()[0] if str(exc) else "CUDA out of memory"
        # Out of the except block: the traceback, and the activations its frames hold, are gone.
        s.optimizer.zero_grad(set_to_none=True)
        free_memory(s.device)
        restore_rng(rng)
        view, decided = SessionView(s), False
        for guard in s.guards:
            verdicts = guard.on_out_of_memory(view, reason, tries)
            decided |= bool(verdicts)
            carry_out(s, guard, verdicts)
        if not decided:
            raise torch.cuda.OutOfMemoryError(reason)
        tries += 1


def after_step(s: Session, metrics: dict[str, Any]) -> bool:
    """The guards look at the counted step, the observers measure, then the guards judge the measurements
    (validation loss). Returns True when a guard ended the run."""
    view, stop = SessionView(s), False
    for guard in s.guards:
        stop |= carry_out(s, guard, guard.after_step(view, metrics))
    for observer in s.observers:
        metrics.update(record(s, observer.observe(view)))
    for guard in s.guards:
        stop |= carry_out(s, guard, guard.after_measuring(view, metrics))
    return stop


def record(s: Session, observation: Observation) -> dict[str, Any]:
    """Write an observation's events; returns its metrics."""
    for event in observation.events:
        write_event(s, event)
    return observation.metrics


# ---- the guards' verdicts, carried out -------------------------------------------------------------------
def carry_out(s: Session, guard: Guard, verdicts: Sequence[Verdict]) -> bool:
    """Act on `guard`'s verdicts, in order. Returns True when one ends the run (early stopping)."""
    stop, state = False, s.state
    for verdict in verdicts:
        match verdict:
            case Report():
                write_event(s, verdict.event)
            case SkipStep():
                s.amp.skip()  # the skipped optimizer step would have done it: an overflow lowers the loss scale
                tensors = [] if verdict.overflow else step.nonfinite_gradients(s.trained)
                write_event(s, verdict.event(state.step + 1, s.amp.loss_scale, tensors, list(state.batch_paths)))
            case TakeSnapshot():
                state.snapshot = take_snapshot(s.params, s.optimizer, state.step) or state.snapshot
            case RollBack():
                source = roll_back(state.snapshot, s.params, s.optimizer, s.run.paths.checkpoints,
                                   lambda adapter: restore_adapter(s.trained, s.ranks, adapter, s.pivotal))
                # the rate it lowers is the schedule's peak: in a warm-up the current one is about 0
                write_event(s, verdict.event(source, *s.lr_scheduler.lower(verdict.lr_factor, verdict.min_lr)))
            case ShrinkMicroBatch():
                state.micro_batch_size = verdict.new
                write_event(s, verdict.event(list(state.batch_paths)))
            case SwapMoreBlocks():
                write_event(s, verdict.event(swap_more_blocks(s.bundle, verdict.new, s.device)))
            case StopOutOfMemory():
                s.run.event(events.OOM_STOP, verdict.message, step=verdict.step)
                save(s, "out of memory")
                s.run.status(states.FAILED, step=state.step, error=verdict.message)
                raise OutOfMemoryStop(verdict.message)
            case LowerLearningRate():
                write_event(s, verdict.event(state.step, *s.lr_scheduler.lower(verdict.factor, verdict.floor)))
            case SwitchPrecision():
                s.amp.switch_to(verdict.precision)
                s.amp.recast_frozen([s.bundle.denoiser, *s.bundle.text_encoders], s.params)
                if s.preview is not None:  # its denoiser samples under the same autocast as the trained one
                    s.amp.recast_frozen([s.preview.denoiser], preview_adapters(s.preview))
                write_event(s, verdict.event)
            case ScaleWeights():
                layers, factors = [s.lora_layers[i] for i in verdict.layers], list(verdict.factors)
                with torch.no_grad():
                    torch._foreach_mul_([layer.down for layer in layers], factors)
                    torch._foreach_mul_([layer.up for layer in layers], factors)
            case SaveBest():
                save(s, verdict.reason)  # every process: save() waits for all of them
                state.best_checkpoint = s.run.paths.checkpoint(state.step)
            case ProtectCheckpoint():
                state.best_checkpoint = None if verdict.step is None else s.run.paths.checkpoint(verdict.step)
            case StopDiverged():
                raise RunFailed(verdict.message)
            case ExportBest():
                export_best(s)
            case StopEarly():
                best = export_best(s)
                write_event(s, verdict.event(best, state.best_checkpoint))
                stop = True
            case _:
                raise TypeError(f"{guard.name} returned {verdict!r}, which the loop does not know how to carry out.")
    return stop


def write_event(s: Session, event: Event) -> None:
    s.run.event(event.kind, event.message, console=event.console, **event.fields)


# ---- the loop's hands: run files, preflight, samples, the UI's commands ---------------------------------------------
def save(s: Session, reason: str) -> Path | None:
    """A checkpoint (run_files.py `save`: a failed one is a console line, CHECKPOINT_FAILURE_LIMIT in a row end it)."""
    return run_files.save(s.files, s.state, reason)


def resume(s: Session) -> None:
    """Continue from the checkpoint setup found (setup read and verified it before loading the model)."""
    run_files.resume(s.files, s.state)


def export(s: Session, name: str | None = None) -> Path | None:
    """The LoRA as trained now (and its EMA beside it): RUN/output/NAME.safetensors, NAME = output_name."""
    return run_files.export(s.files, name or s.config.output_name, step=s.state.step, epoch=s.state.epoch)


def export_best(s: Session) -> Path | None:
    """The best checkpoint as <output_name>_best (early stopping); the current weights stay as they are."""
    best = s.state.best_checkpoint
    return run_files.export_best(s.files, Path(best), epoch=s.state.epoch) if best else None


def run_preflight(s: Session) -> dict[str, Any]:
    """preflight.py's measurements with this run's step and sampling."""
    return measure_run(s.config, s.data, s.state, s.step_parts, s.samples, s.optimizer)


def apply_preflight(s: Session) -> None:
    """Run the preflight inside a training run; on a GPU start at the largest micro-batch that fits."""
    report = run_preflight(s)
    if 0 < (largest := report.get("largest_micro_batch") or 0) < s.state.micro_batch_size:
        report["micro_batch_size"] = s.state.micro_batch_size = largest
    s.run.event(events.PREFLIGHT, describe(report), step=s.state.step, **report)


def sample(s: Session, *, then: str = states.TRAINING) -> None:
    """The validation images of this step (samples.py `take_samples`: after the rest of a deferred sampling)."""
    if s.ranks.is_main:
        take_samples(s.samples, s.state, lambda sampling: samples_made(s, sampling), then=then)


def samples_made(s: Session, sampling: Sampling) -> None:
    """Say so; the observers (the sample judge) look at a complete sampling only."""
    announce(s.run, sampling)
    if sampling.complete:
        view = SessionView(s, step=sampling.step)
        for observer in s.observers:
            record(s, observer.on_samples(view, sampling.folder, sampling.paths))


def obey_control(s: Session) -> bool:
    """The UI's commands, between steps (control.py); True when the run is to stop."""
    return obey(s.run, s.ranks, step=s.state.step, max_steps=s.max_steps, save=lambda: save(s, "asked from the UI"),
                sample=(lambda then: sample(s, then=then)) if s.config.validation_prompts else None)
