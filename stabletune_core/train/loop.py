"""The training loop. Read it top to bottom: set up, resume, then one optimizer step at a time.

One step is `training_step` below with two helpers from step.py, each taking what it uses as arguments:
`forward_backward` (the family's objective noises the batch, the denoiser predicts, the loss goes backward over
micro-batches) and `clip_gradients`. Everything that makes a run survive (non-finite losses, out-of-memory,
clipping, early stopping) lives in guard objects (guards/) called at fixed points of the step; a guard returns
verdicts and `carry_out`, below, acts on them, in one place, because only the loop owns the weights, the
optimizer, the step counter and the run folder. Observers (observers.py) measure and record; everything the
world should know goes to the run directory through `RunWriter`. Nothing imports this module but the entry
points (cli.py).
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from ..config import TrainConfig
from ..lora.inject import adapter_settings
from ..models.base import ModelBundle
from ..runs import events
from ..tools.image_losses import loss_record
from . import signals, step
from .checkpoint import (CheckpointError, latest_good_checkpoint, list_checkpoints, load_checkpoint,
                         prune_checkpoints, save_checkpoint)
from .deferred import DeferredSampling
from .ema import optional_swap
from .guards import Guard, OutOfMemoryStop
from .guards.out_of_memory import free_memory
from .guards.verdicts import (Event, ExportBest, LowerLearningRate, ProtectCheckpoint, Report, RollBack, SaveBest,
                              ScaleWeights, ShrinkMicroBatch, SkipStep, StopDiverged, StopEarly, StopOutOfMemory,
                              SwapMoreBlocks, SwitchPrecision, TakeSnapshot, Verdict)
from .lora_file import write_lora
from .memory_stats import memory_stats
from .noise import NoiseOptions
from .placement import swap_more_blocks
from .observers.base import Observation
from .optim import evaluation_weights
from .outcome import RunFailed
from .preflight import describe, preflight
from .rollback import restore_snapshot, take_snapshot
from .session import Session, SessionView
from .setup import setup
from .state import adapter_state, restore_adapter, restore_rng, restore_run_state, rng_state, run_state
from .preview import preview_adapters, with_trained_adapters
from .validation_images import image_count, make_validation_images

#: status.json while training is rewritten at most this often: the UI polls it about once a second, and a
#: fast step would otherwise spend more on the heartbeat than on all the guards together (bench/RESULTS.md).
HEARTBEAT_SECONDS = 0.5
CHECKPOINT_FAILURE_LIMIT = 3  # checkpoints in a row that may fail (a full disk) before the run stops


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
    if s.config.validation_prompts and state.step == 0 and not stop_signal(s):
        state.deferred = defer_sampling(s)  # made one image per step from step 1 on: training starts at once
    run.status("training", step=state.step, max_steps=s.max_steps)
    progress = tqdm(total=s.max_steps, initial=state.step, desc="training", unit="step", disable=not s.ranks.is_main)
    last_time, sec_per_step = time.perf_counter(), None
    last_heartbeat = -math.inf
    stop_reason = "finished"
    first_step = state.step
    for module in s.trained.values():
        module.train()
    for guard in s.guards:
        carry_out(s, guard, guard.on_start(view))
    try:  # the progress bar ends its line whatever happens, so a failure sentence starts on its own
        while state.step < s.max_steps:
            signum = stop_signal(s)
            if signum:
                if signals.ACTIVE is not None:
                    signals.ACTIVE.honoured = True
                run.event(events.STOP_REQUESTED, f"{signals.signal_name(signum)} at step {state.step}; saving a "
                          "checkpoint and the LoRA.", step=state.step, console=True)
                stop_reason = "stopped"
                break
            freeze_embeddings(s)
            batches = step.next_batches(s.feed, state, s.config.gradient_accumulation_steps)
            state.batch_paths = [str(p) for b in batches for p in b["path"]]
            loss, grad_norm, clip_threshold = training_step(s, batches)
            state.step += 1
            if loss.per_image is not None:
                run.image_losses(loss_record(state.step, loss.per_image.paths, loss.per_image.losses,
                                             loss.per_image.timesteps, loss.per_image.reg))
            state.images_seen += s.ranks.total(sum(len(b["caption"]) for b in batches))

            now = time.perf_counter()
            sec_per_step = (now - last_time) if sec_per_step is None else 0.9 * sec_per_step + 0.1 * (now - last_time)
            last_time = now
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
            if now - last_heartbeat >= HEARTBEAT_SECONDS or state.step == s.max_steps:
                run.status("training", step=state.step, max_steps=s.max_steps, epoch=state.epoch,
                           sec_per_step=sec_per_step, eta_seconds=sec_per_step * (s.max_steps - state.step),
                           loss=loss.mean)
                last_heartbeat = now
            progress.update(1)
            progress.set_postfix(loss=f"{loss.mean:.4f}")
            if s.config.validation_prompts and state.step % s.config.validation_steps == 0:
                sample(s)
            if state.step % s.config.save_steps == 0 and state.step < s.max_steps:
                save(s, "every save_steps")
            if state.deferred is not None and state.step % state.deferred.every == 0:
                sample_deferred(s, state.deferred, 1)
            if guard_stops or obey_control(s) == "stop":
                stop_reason = "stopped"
                break
    finally:
        progress.close()
    for guard in s.guards:
        carry_out(s, guard, guard.on_end(view))
    if state.step == first_step and stop_reason == "stopped":  # stopped before any step: nothing new to keep
        run.status("stopped", step=state.step, max_steps=s.max_steps, eta_seconds=0)
        run.event(events.STOPPED, f"Run stopped at step {state.step} before training a step; nothing new to save.",
                  step=state.step, console=True)
        return None
    if state.deferred is not None and not end_deferred(s, state.deferred, make_the_rest=stop_reason == "finished"):
        stop_reason = "stopped"  # main process only, which alone writes the outcome; every process saves alike
    save(s, stop_reason)
    final_checkpoint_failed = state.checkpoint_failures > 0
    path = export(s)
    ended = [observer.on_end(view) for observer in s.observers]
    if final_checkpoint_failed:
        written = f"the LoRA was written to {path}" if path else "the LoRA was not written"
        raise RunFailed(f"The final checkpoint at step {state.step} could not be written ({written}); "
                        f"{last_good_sentence(s)}")
    summary = next((o.summary for o in ended if o.summary), None)
    run.status(stop_reason, step=state.step, max_steps=s.max_steps, eta_seconds=0, lora=str(path) if path else None,
               summary=summary)
    run.event(stop_reason, f"Run {stop_reason} at step {state.step}.", step=state.step,
              console=stop_reason == "stopped")
    for observation in ended:
        record(s, observation)
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


def freeze_embeddings(s: Session) -> None:
    """Pivotal tuning: from `pivotal_freeze_step` on (embedding_train_fraction of the run) the new token rows get
    no gradient, so they stay bitwise as they are while the LoRA goes on learning around them. A resumed run
    past that step freezes them before its first step, as the uninterrupted run did."""
    if s.pivotal is None or not s.pivotal.training or s.state.step < s.pivotal_freeze_step:
        return
    s.pivotal.set_training(False)
    s.run.event(events.CONFIG, f"Pivotal tuning: the new token embeddings freeze at step {s.state.step} "
                f"(embedding_train_fraction {s.config.embedding_train_fraction:g}); the LoRA trains on.",
                step=s.state.step, console=True)


def forward_backward(s: Session, batches: list[dict[str, Any]], *, micro_batch_size: int | None = None
                     ) -> step.StepLoss:
    """`step.forward_backward` with this run's pieces (the micro-batch: the state's unless given)."""
    config = s.config
    return step.forward_backward(
        batches, inputs=s.inputs, objective=s.objective, denoiser=s.denoiser, trained=s.trained, params=s.params,
        amp=s.amp, ranks=s.ranks, micro_batch_size=micro_batch_size or s.state.micro_batch_size,
        noise=NoiseOptions.from_config(config), masked_loss=config.masked_loss,
        prior_loss_weight=config.prior_loss_weight, perceptual=s.perceptual, step=s.state.step)


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
                skip_step(s, verdict)
            case TakeSnapshot():
                state.snapshot = take_snapshot(s.params, s.optimizer, state.step) or state.snapshot
            case RollBack():
                roll_back(s, verdict)
            case ShrinkMicroBatch():
                state.micro_batch_size = verdict.new
                s.run.event(events.OOM, f"Out of memory at step {verdict.step} with micro-batch {verdict.old} "
                            f"({verdict.reason}); retrying with micro-batch {verdict.new} and twice the accumulation, "
                            "so the effective batch stays the same.", step=verdict.step, old_micro_batch=verdict.old,
                            new_micro_batch=verdict.new, paths=list(state.batch_paths), console=True)
            case SwapMoreBlocks():
                added = swap_more_blocks(s.bundle, verdict.new, s.device)
                s.run.event(events.OOM, f"Out of memory at step {verdict.step} with micro-batch 1 ({verdict.reason}); "
                            f"retrying with {verdict.new} transformer blocks in CPU memory instead of {verdict.old} "
                            "(block swap: slower, the same numbers).", step=verdict.step,
                            old_blocks_swapped=verdict.old, new_blocks_swapped=verdict.new, blocks=added,
                            console=True)
            case StopOutOfMemory():
                s.run.event(events.OOM_STOP, verdict.message, step=verdict.step)
                save(s, "out of memory")
                s.run.status("failed", step=state.step, error=verdict.message)
                raise OutOfMemoryStop(verdict.message)
            case LowerLearningRate():
                old, new = s.lr_scheduler.lower(verdict.factor, verdict.floor)
                s.run.event(events.LR_PLATEAU, f"Validation loss has not improved on {verdict.best:.4g} for "
                            f"{verdict.patience} evaluations; learning rate {old:.3g} -> {new:.3g}.",
                            step=state.step, old_lr=old, new_lr=new)
            case SwitchPrecision():
                s.amp.switch_to(verdict.precision)
                s.amp.recast_frozen([s.bundle.unet, *s.bundle.text_encoders], s.params)
                if s.preview is not None:  # its denoiser samples under the same autocast as the trained one
                    s.amp.recast_frozen([s.preview.unet], preview_adapters(s.preview))
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


def skip_step(s: Session, verdict: SkipStep) -> None:
    """No optimizer step this time; say why, naming the tensors that went non-finite."""
    step_number = s.state.step + 1
    s.amp.skip()  # the skipped optimizer step would have done it: an overflow lowers the loss scale
    if verdict.overflow:
        s.run.event(events.FP16_OVERFLOW, f"Skipped step {step_number}: fp16 gradients overflowed; loss scale is now "
                    f"{s.amp.loss_scale:g}.", step=step_number)
        return
    tensors = step.nonfinite_gradients(s.trained)
    detail = f" in {len(tensors)} gradient tensors, e.g. {', '.join(tensors[:3])}" if tensors else ""
    s.run.event(events.NONFINITE, f"Skipped step {step_number}: non-finite {verdict.what} (loss {verdict.loss}, "
                f"grad norm {verdict.grad_norm}){detail}.", step=step_number, what=verdict.what, tensors=tensors[:20],
                paths=list(s.state.batch_paths))


def roll_back(s: Session, verdict: RollBack) -> None:
    """Weights and optimizer back to the last good state, and a lower learning rate."""
    snapshot = s.state.snapshot
    if snapshot is not None:
        restore_snapshot(s.params, s.optimizer, snapshot)
        source = f"rolled the LoRA and optimizer back to step {snapshot.step} (in memory)"
    elif (checkpoint := latest_good_checkpoint(s.run.paths.checkpoints)) is not None:
        restore_adapter(s.trained, s.ranks, checkpoint.adapter, s.pivotal)
        s.optimizer.load_state_dict(checkpoint.state["optimizer"])
        source = f"rolled the LoRA and optimizer back to checkpoint {checkpoint.path.name}"
    else:
        source = "no good state to roll back to (no snapshot, no checkpoint), kept the current weights"
    old, new = s.lr_scheduler.lower(verdict.lr_factor, verdict.min_lr)  # peaks: the rate is ~0 in a warm-up
    s.run.event(events.ROLLBACK, f"{len(verdict.bad_steps)} non-finite steps within {verdict.window} steps (last at "
                f"step {verdict.step}): {source}; learning rate {old:.3g} -> {new:.3g}.", step=verdict.step, old_lr=old,
                new_lr=new, bad_steps=list(verdict.bad_steps), console=True)


# ---- checkpoints and LoRA files -------------------------------------------------------------------------------
def save(s: Session, reason: str) -> Path | None:
    """Write a checkpoint. A failed one (a full disk) is one console line and the run goes on, keeping the last
    good checkpoint; CHECKPOINT_FAILURE_LIMIT failures in a row stop the run with a sentence."""
    s.ranks.wait()
    if not s.ranks.is_main:
        return None
    state = s.state
    s.run.status("saving", step=state.step)
    saved = run_state(state, s.optimizer, s.lr_scheduler, s.amp, s.ema, [*s.guards, *s.observers],
                      adapter_settings(s.config))
    try:
        folder = save_checkpoint(s.run.paths.checkpoint(state.step), state.step,
                                 adapter_state(s.trained, s.ranks, s.pivotal), saved, halfway=s.checkpoint_halfway)
    except CheckpointError as exc:
        state.checkpoint_failures += 1
        s.run.event(events.CHECKPOINT_FAILED, str(exc), step=state.step, console=True)
        if state.checkpoint_failures >= CHECKPOINT_FAILURE_LIMIT:
            raise RunFailed(f"Stopped at step {state.step} because {state.checkpoint_failures} checkpoints in a row "
                            f"could not be written ({exc.reason or exc}); {last_good_sentence(s)}") from None
        s.run.status("training", step=state.step, max_steps=s.max_steps, error=str(exc))
        return None
    state.checkpoint_failures = 0
    protect = {state.best_checkpoint} if state.best_checkpoint else set()
    removed = prune_checkpoints(s.run.paths.checkpoints, s.config.checkpoints_total_limit, protect=protect)
    s.run.event(events.CHECKPOINT, f"Saved checkpoint at step {state.step} ({reason}).", step=state.step,
                path=str(folder), removed=[str(p) for p in removed])
    return folder


def last_good_sentence(s: Session) -> str:
    """What to do after checkpoints failed, naming the last good one (lower case: it ends a sentence)."""
    folders = list_checkpoints(s.run.paths.checkpoints)
    if not folders:
        return "free some space and start the run again (it has no checkpoint yet)."
    return f"free some space and continue with --resume auto from the last good checkpoint, {folders[-1].name}."


def resume(s: Session) -> None:
    """Continue from the checkpoint setup found (setup read and verified it before loading the model)."""
    checkpoint, state = s.state.resume_from, s.state
    if checkpoint is None:
        return
    state.resume_from = None  # its tensors are not needed once loaded
    restore_adapter(s.trained, s.ranks, checkpoint.adapter, s.pivotal)
    ema_kept = restore_run_state(checkpoint.state, state, s.optimizer, s.lr_scheduler, s.amp, s.ema,
                                 [*s.guards, *s.observers])
    if not ema_kept:
        s.run.event(events.CONFIG, f"{checkpoint.path.name} holds no EMA weights (ema_decay was 0 then); the EMA "
                    f"starts from the resumed weights at step {state.step}.", step=state.step, console=True)
    s.run.event(events.RESUMED_FROM_CHECKPOINT, f"Resumed from {checkpoint.path} at step {state.step} "
                f"({state.images_seen} images seen, micro-batch {state.micro_batch_size}).", step=state.step,
                path=str(checkpoint.path), images_seen=state.images_seen)


def export(s: Session, name: str | None = None, *, step: int | None = None) -> Path | None:
    """The LoRA as trained, and with ema_decay its moving average beside it as NAME-ema.safetensors. `step`: the
    step the weights come from (the file's ss_steps), when not the current one."""
    name = name or s.config.output_name
    where = dict(step=s.state.step if step is None else step, epoch=s.state.epoch, max_steps=s.max_steps,
                 config=s.config, ranks=s.ranks, run=s.run, bundle=s.bundle, trained=s.trained, data=s.data,
                 pivotal=s.pivotal)
    with evaluation_weights(s.optimizer):  # schedule-free: export the averaged weights, not the training point
        path = write_lora(name, **where)
    if s.ema:
        with s.ema.swapped_in():
            write_lora(f"{name}-ema", **where)
    return path


def export_best(s: Session) -> Path | None:
    """Export the best checkpoint as <output_name>_best, then put the current state back.

    Everything the export reads comes from the best step: the adapter, the EMA beside it (`_best-ema` is the
    average *at* the best step, not the one of the last step) and the optimizer state (a schedule-free
    optimizer's evaluation weights are computed from it)."""
    if not s.state.best_checkpoint:
        return None
    best = load_checkpoint(Path(s.state.best_checkpoint))
    current = adapter_state(s.trained, s.ranks, s.pivotal)
    current_optimizer = s.optimizer.state_dict()  # load_state_dict replaces these tensors, it does not write them
    current_ema = s.ema.state_dict() if s.ema else None
    try:
        restore_adapter(s.trained, s.ranks, best.adapter, s.pivotal)
        s.optimizer.load_state_dict(best.state["optimizer"])
        if s.ema and best.state.get("ema"):
            s.ema.load_state_dict(best.state["ema"])
        return export(s, f"{s.config.output_name}_best", step=best.step)  # ss_steps: the step it comes from
    finally:
        restore_adapter(s.trained, s.ranks, current, s.pivotal)
        s.optimizer.load_state_dict(current_optimizer)
        if current_ema is not None:
            s.ema.load_state_dict(current_ema)


# ---- before training: the preflight -----------------------------------------------------------------------------
def run_preflight(s: Session) -> dict[str, Any]:
    """preflight.py's measurements with this run's step and sampling."""
    config = s.config
    sampling = config.model_copy(update={"validation_prompt": config.validation_prompt or "preflight",
                                         "num_validation_images": 1, "validation_inference_steps": 2})
    return preflight(s.data, batch_size=config.train_batch_size, micro_batch_size=s.state.micro_batch_size,
                     with_pixels=s.inputs.latent_cache is None, position=(s.state.epoch, s.state.batch_in_epoch),
                     step=lambda batches, micro: forward_backward(s, batches, micro_batch_size=micro),
                     optimizer=s.optimizer, device=s.device,
                     render=lambda folder: make_validation_images(s.bundle, sampling, folder, s.device,
                                                                  autocast=s.amp.autocast))


def apply_preflight(s: Session) -> dict[str, Any]:
    """Run the preflight inside a training run; on a GPU start at the largest micro-batch that fits."""
    report = run_preflight(s)
    largest = report.get("largest_micro_batch")
    if largest is not None and 0 < largest < s.state.micro_batch_size:
        report["micro_batch_size"] = s.state.micro_batch_size = largest
    s.run.event(events.PREFLIGHT, describe(report), step=s.state.step, **report)
    return report


# ---- between steps: signals, samples, the UI's commands -----------------------------------------------------
def stop_signal(s: Session) -> int | None:
    """The Ctrl-C / SIGTERM the CLI caught, if any; with several processes the main one's, so every rank stops
    at the same step."""
    return s.ranks.from_main(signals.requested())


def sample(s: Session, *, then: str = "training") -> None:
    """The validation images of this step (after the rest of a deferred sampling: samplings stay in step order).
    A stop asked for meanwhile ends it at the next image."""
    if not s.ranks.is_main:
        return
    if s.state.deferred is not None and not sample_deferred(s, s.state.deferred, None, then=then):
        return  # a stop is waiting
    step_now = s.state.step
    s.run.status("sampling", step=step_now, max_steps=s.max_steps, sampling_step=step_now)
    folder = s.run.paths.sample_dir(step_now)
    with evaluation_weights(s.optimizer), optional_swap(s.ema, s.config.validation_with_ema):
        paths = make_validation_images(sampling_bundle(s), s.config, folder, s.device, autocast=s.amp.autocast,
                                       should_stop=lambda: stop_waiting(s))
    samples_made(s, step_now, folder, paths, due=image_count(s.config))
    s.run.status(then, step=step_now, max_steps=s.max_steps)


def sampling_bundle(s: Session) -> ModelBundle:
    """What the validation images are made with: the trained model, or the preview model (preview_model)
    carrying the adapter weights the trained one holds now."""
    return s.bundle if s.preview is None else with_trained_adapters(s.preview, s.bundle.unet)


def samples_made(s: Session, step_taken: int, folder: Path, paths: list[Path], *, due: int) -> None:
    """Say so; the observers (the sample judge) look at a complete sampling only."""
    if len(paths) < due:
        s.run.event(events.SAMPLES, f"Made {len(paths)} of {due} validation images at step {step_taken}; a stop "
                    "ended the sampling.", step=step_taken)
        return
    s.run.event(events.SAMPLES, f"Made {len(paths)} validation images at step {step_taken}.", step=step_taken)
    view = SessionView(s, step=step_taken)
    for observer in s.observers:
        record(s, observer.on_samples(view, folder, paths))


def stop_waiting(s: Session) -> bool:
    """A stop asked for (Ctrl-C, SIGTERM, the UI) that the loop has not acted on yet. Main process only: asked
    while sampling, which only the main process does."""
    return signals.requested() is not None or s.run.stop_waiting()


def end_deferred(s: Session, deferred: DeferredSampling, *, make_the_rest: bool) -> bool:
    """At the end of training: make the images still due, or, when the run stops, say how many were made.
    Returns False when a stop asked for while making them ended them (the run then ends `stopped`)."""
    if make_the_rest:
        if sample_deferred(s, deferred, None):
            return True
        s.run.take_control()  # the stop is acted on here: a later resume must not find it
        if signals.ACTIVE is not None and signals.requested():
            signals.ACTIVE.honoured = True
        s.run.event(events.STOP_REQUESTED, f"Stop requested at step {s.state.step} while making the step-"
                    f"{deferred.step} validation images; saving and exporting.", step=s.state.step)
        return False
    s.state.deferred = None
    samples_made(s, deferred.step, deferred.folder, deferred.made, due=deferred.due)
    return True


def defer_sampling(s: Session) -> DeferredSampling | None:
    """Freeze this step's adapter weights as the validation images use them, to make the images later."""
    if not s.ranks.is_main:
        return None
    with evaluation_weights(s.optimizer), optional_swap(s.ema, s.config.validation_with_ema):
        weights = adapter_state(s.trained, s.ranks, s.pivotal)
    due = image_count(s.config)
    until_next = min(s.config.validation_steps, s.max_steps - s.state.step)  # the next sampling, or the end
    return DeferredSampling(s.state.step, s.run.paths.sample_dir(s.state.step), weights, due,
                            every=max(1, until_next // due))


def sample_deferred(s: Session, deferred: DeferredSampling, count: int | None, *, then: str = "training") -> bool:
    """Make `count` more of a deferred sampling's images (None: the rest) with the weights it froze, then put
    the training weights back. Returns True once all are made (the deferral is then over), False when a stop
    is waiting."""
    s.run.status("sampling", step=s.state.step, max_steps=s.max_steps, sampling_step=deferred.step)
    current = adapter_state(s.trained, s.ranks, s.pivotal)
    restore_adapter(s.trained, s.ranks, deferred.weights, s.pivotal)
    try:
        deferred.made += make_validation_images(sampling_bundle(s), s.config, deferred.folder, s.device,
                                                autocast=s.amp.autocast, only=deferred.next_images(count),
                                                should_stop=lambda: stop_waiting(s))
    finally:
        restore_adapter(s.trained, s.ranks, current, s.pivotal)
    s.run.status(then, step=s.state.step, max_steps=s.max_steps)
    if deferred.done or (count is None and stop_waiting(s)):
        s.state.deferred = None
        samples_made(s, deferred.step, deferred.folder, deferred.made, due=deferred.due)
    return deferred.done


def sample_now(s: Session, state_after: str) -> None:
    """The UI's "Sample now". Sampling draws from its own seeded generators, never from the training RNG, so
    a run sampled on request still ends bitwise equal to one that was not."""
    if not s.config.validation_prompts:
        s.run.event(events.SAMPLES, "Sample now: this run has no validation prompt, so there is nothing to render "
                    "(set validation_prompt for the next run).", step=s.state.step, console=True)
        return
    sample(s, then=state_after)


def obey_control(s: Session) -> str | None:
    """Commands from the UI, between steps: save, sample, stop, pause (then wait for resume or stop)."""
    command = take_control(s)
    paused = False
    while command or paused:
        kind = (command or {}).get("command")
        if kind == "save":
            save(s, "asked from the UI")
        elif kind == "sample":
            sample_now(s, "paused" if paused else "training")
        elif kind == "stop":
            s.run.event(events.STOP_REQUESTED, f"Stop requested at step {s.state.step}; saving and exporting.",
                        step=s.state.step)
            return "stop"
        elif kind == "pause" and not paused:
            paused = True
            s.run.status("paused", step=s.state.step, max_steps=s.max_steps)
            s.run.event(events.PAUSED, f"Paused at step {s.state.step}.", step=s.state.step)
        elif kind == "resume" and paused:
            s.run.event(events.UNPAUSED, f"Continuing from step {s.state.step}.", step=s.state.step)
            s.run.status("training", step=s.state.step, max_steps=s.max_steps)
            return None
        if paused:
            time.sleep(0.5)
            s.run.status("paused", step=s.state.step, max_steps=s.max_steps)  # keep the heartbeat fresh
        command = take_control(s)
    return None


def take_control(s: Session) -> dict[str, Any] | None:
    """The main process reads control.json; with several processes every rank must get the same command,
    or the others would train on (or wait in a save) while the main one stops."""
    return s.ranks.from_main(s.run.take_control())
