"""The training loop. Read it top to bottom: set up, resume, then one optimizer step at a time.

Everything that makes a run survive (non-finite losses, out-of-memory, clipping, early stopping) lives in guard
objects (guards/) called at fixed points of the step; a guard returns verdicts and `carry_out`, below, acts on
them, in one place, because only the loop owns the weights, the optimizer, the step counter and the run folder.
Observers (observers.py) measure; everything the world should know goes to the run directory through
`RunWriter`. Nothing imports this module but the entry points (cli.py).
"""
from __future__ import annotations

import copy
import math
import signal
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm.auto import tqdm

from ..config import TrainConfig
from . import signals, step
from .export import export, export_best
from .guards import Guard, OutOfMemoryStop
from .guards.memory import free_memory
from .guards.verdicts import (Event, ExportBest, LowerLearningRate, ProtectCheckpoint, Report, RollBack, SaveBest,
                              ScaleWeights, ShrinkMicroBatch, SkipStep, StopEarly, StopOutOfMemory, SwitchPrecision,
                              TakeSnapshot, Verdict)
from .memory import memory_stats
from .optim import evaluation_weights
from .ema import optional_swap
from .outcome import RunFailed
from .sampling import make_validation_images
from .session import Session, SessionView, Snapshot
from .setup import setup
from .state import last_good_sentence, restore_adapter, restore_rng, resume, rng_state, save
from .checkpoint import latest_good_checkpoint


#: status.json while training is rewritten at most this often: the UI polls it about once a second, and a
#: fast step would otherwise spend more on the heartbeat than on all the guards together (bench/RESULTS.md).
HEARTBEAT_SECONDS = 0.5


# ---- the loop ------------------------------------------------------------------------------------------
def train(config: TrainConfig, *, session: Session | None = None) -> Path | None:
    """Train a LoRA as `config` says and return the exported file (None on non-main processes).

    Ends `finished`, or `stopped` (the UI, early stopping, Ctrl-C / SIGTERM) after a last checkpoint and the LoRA;
    a run that cannot go on raises (RunFailed and friends) and the CLI records it as `failed` (train/outcome.py).
    """
    s = session or setup(config)
    resume(s)
    run, state = s.run, s.state
    if s.config.preflight:
        from .preflight import apply_preflight

        apply_preflight(s)
    if s.config.validation_prompts and state.step == 0 and not stop_signal(s):
        sample(s)
    run.status("training", step=state.step, max_steps=s.max_steps)
    progress = tqdm(total=s.max_steps, initial=state.step, desc="training", unit="step",
                    disable=not s.accelerator.is_main_process)
    last_time, sec_per_step = time.perf_counter(), None
    last_heartbeat = -math.inf
    stop_reason = "finished"
    first_step = state.step
    for module in s.trained.values():
        module.train()
    for guard in s.guards:
        carry_out(s, guard, guard.on_start(SessionView(s)))
    try:  # the progress bar ends its line whatever happens, so a failure sentence starts on its own
        while state.step < s.max_steps:
            signum = stop_signal(s)
            if signum:
                if signals.ACTIVE is not None:
                    signals.ACTIVE.honoured = True
                run.event("stop", f"{signal_name(signum)} at step {state.step}; saving a checkpoint and the LoRA.",
                          step=state.step, console=True)
                stop_reason = "stopped"
                break
            batches = step.next_batches(s, s.config.gradient_accumulation_steps)
            s.batch_paths = [str(p) for b in batches for p in b["path"]]
            loss, grad_norm = training_step(s, batches)
            state.step += 1
            state.images_seen += step.global_image_count(s, batches)

            now = time.perf_counter()
            sec_per_step = (now - last_time) if sec_per_step is None else 0.9 * sec_per_step + 0.1 * (now - last_time)
            last_time = now
            metrics = dict(loss=loss, lr=s.lr_scheduler.get_last_lr()[0], grad_norm=grad_norm,
                           clip_threshold=None, epoch=state.epoch, images_seen=state.images_seen,
                           sec_per_step=sec_per_step, micro_batch_size=state.micro_batch_size)
            if s.config.reg_data_dir:
                metrics.update(s.loss_parts.means())
            guard_stops = after_step(s, metrics)
            if state.step % s.config.logging_steps == 0 or state.step == s.max_steps:
                logged = {**metrics, **memory_stats(s.device)}
                run.metric(state.step, **logged)
                if s.tensorboard:
                    s.tensorboard.log_metrics(state.step, logged)
            if now - last_heartbeat >= HEARTBEAT_SECONDS or state.step == s.max_steps:
                run.status("training", step=state.step, max_steps=s.max_steps, epoch=state.epoch,
                           sec_per_step=sec_per_step, eta_seconds=sec_per_step * (s.max_steps - state.step), loss=loss)
                last_heartbeat = now
            progress.update(1)
            progress.set_postfix(loss=f"{loss:.4f}")
            nonfinite = s.guard("nonfinite")
            if nonfinite is not None and nonfinite.hopeless(state.step - first_step):
                raise RunFailed(nonfinite.hopeless_sentence(s.config, current_lr(s), state.step - first_step))
            if s.config.validation_prompts and state.step % s.config.validation_steps == 0:
                sample(s)
            if state.step % s.config.save_steps == 0 and state.step < s.max_steps:
                save(s, "every save_steps")
            if guard_stops or obey_control(s) == "stop":
                stop_reason = "stopped"
                break
    finally:
        progress.close()
    nonfinite = s.guard("nonfinite")
    if nonfinite is not None and state.step > first_step and nonfinite.hopeless(state.step - first_step, end=True):
        raise RunFailed(nonfinite.hopeless_sentence(s.config, current_lr(s), state.step - first_step))
    if state.step == first_step and stop_reason == "stopped":  # stopped before any step: nothing new to keep
        run.status("stopped", step=state.step, max_steps=s.max_steps, eta_seconds=0)
        run.event("stopped", f"Run stopped at step {state.step} before training a step; nothing new to save.",
                  step=state.step, console=True)
        return None
    save(s, stop_reason)
    final_checkpoint_failed = s.checkpoint_failures > 0
    path = export(s)
    if s.tensorboard:
        s.tensorboard.close()
    if final_checkpoint_failed:
        written = f"the LoRA was written to {path}" if path else "the LoRA was not written"
        raise RunFailed(f"The final checkpoint at step {state.step} could not be written ({written}); "
                        f"{last_good_sentence(s)}")
    summary = learning_summary(s.sample_scores) if s.sample_scores else None
    run.status(stop_reason, step=state.step, max_steps=s.max_steps, eta_seconds=0, lora=str(path) if path else None,
               summary=summary)
    run.event(stop_reason, f"Run {stop_reason} at step {state.step}.", step=state.step,
              console=stop_reason == "stopped")
    if summary:
        run.event("learning", summary, step=state.step, console=True)
    return path


# ---- one step -----------------------------------------------------------------------------------------
def training_step(s: Session, batches: list[dict[str, Any]]) -> tuple[float, float]:
    """Forward, backward, clip, ask the guards, optimizer step. Returns (loss, gradient norm before clipping)."""
    loss = forward_backward_fitting(s, batches)
    grad_norm = step.clip_gradients(s)
    view, skip = SessionView(s), False
    for guard in s.guards:
        verdicts = guard.before_optimizer_step(view, loss, grad_norm)
        skip |= any(isinstance(v, (SkipStep, RollBack)) for v in verdicts)
        carry_out(s, guard, verdicts)
    if not skip:
        s.amp.step(s.optimizer)
        if s.ema:
            s.ema.update()
    s.lr_scheduler.step()
    s.optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


def forward_backward_fitting(s: Session, batches: list[dict[str, Any]]) -> float:
    """`step.forward_backward`; with the memory guard, an out-of-memory error frees the step's memory, puts the
    random-number state back (the retry draws exactly what the failed attempt drew) and asks the guard."""
    memory = s.guard("memory")
    if memory is None:
        return step.forward_backward(s, batches)
    rng = rng_state(s)
    tries = 0
    while True:
        try:
            return step.forward_backward(s, batches)
        except torch.cuda.OutOfMemoryError as exc:
            reason = str(exc).splitlines()[0] if str(exc) else "CUDA out of memory"
        # Out of the except block: the traceback, and the activations its frames hold, are gone.
        s.optimizer.zero_grad(set_to_none=True)
        free_memory(s.device)
        restore_rng(s, rng)
        carry_out(s, memory, memory.on_out_of_memory(SessionView(s), reason, tries))
        tries += 1


def after_step(s: Session, metrics: dict[str, Any]) -> bool:
    """The guards look at the counted step, the observers measure, then the guards judge the measurements
    (validation loss). Returns True when a guard ended the run."""
    view, stop = SessionView(s), False
    for guard in s.guards:
        stop |= carry_out(s, guard, guard.after_step(view, metrics))
    for observer in s.observers:
        observation = observer.observe(s)
        metrics.update(observation.metrics)
        for event in observation.events:
            write_event(s, event)
    for guard in s.guards:
        stop |= carry_out(s, guard, guard.after_measuring(view, metrics))
    return stop


def current_lr(s: Session) -> float:
    return s.optimizer.param_groups[0]["lr"]


# ---- the guards' verdicts, carried out -------------------------------------------------------------------
def carry_out(s: Session, guard: Guard, verdicts: Sequence[Verdict]) -> bool:
    """Act on `guard`'s verdicts, in order. Returns True when one ends the run (early stopping)."""
    stop = False
    for verdict in verdicts:
        match verdict:
            case Report():
                write_event(s, verdict.event)
            case SkipStep():
                skip_step(s, verdict)
            case TakeSnapshot():
                s.snapshot = take_snapshot(s) or s.snapshot
            case RollBack():
                roll_back(s, verdict)
            case ShrinkMicroBatch():
                s.state.micro_batch_size = verdict.new
                s.run.event("oom", f"Out of memory at step {verdict.step} with micro-batch {verdict.old} "
                            f"({verdict.reason}); retrying with micro-batch {verdict.new} and twice the accumulation, "
                            "so the effective batch stays the same.", step=verdict.step, old_micro_batch=verdict.old,
                            new_micro_batch=verdict.new, paths=list(s.batch_paths), console=True)
            case StopOutOfMemory():
                s.run.event("oom_stop", verdict.message, step=verdict.step)
                save(s, "out of memory")
                s.run.status("failed", step=s.state.step, error=verdict.message)
                raise OutOfMemoryStop(verdict.message)
            case LowerLearningRate():
                old, new = s.lr_scheduler.lower(verdict.factor, verdict.floor)
                s.run.event("lr_plateau", f"Validation loss has not improved on {verdict.best:.4g} for "
                            f"{verdict.patience} evaluations; learning rate {old:.3g} -> {new:.3g}.",
                            step=s.state.step, old_lr=old, new_lr=new)
            case SwitchPrecision():
                switch_precision(s, verdict.precision)
                write_event(s, verdict.event)
            case ScaleWeights():
                with torch.no_grad():
                    for tensors, factors in zip(verdict.tensors, verdict.factors):
                        torch._foreach_mul_(tensors, factors)
            case SaveBest():
                save(s, verdict.reason)  # every process: save() waits for all of them
                s.best_checkpoint = s.run.paths.checkpoint(s.state.step)
                guard.remember_best(s.best_checkpoint)
            case ProtectCheckpoint():
                s.best_checkpoint = verdict.path
            case ExportBest():
                export_best(s)
            case StopEarly():
                best = export_best(s)
                write_event(s, verdict.event(best, s.best_checkpoint))
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
        s.run.event("fp16_overflow", f"Skipped step {step_number}: fp16 gradients overflowed; loss scale is now "
                    f"{s.amp.loss_scale:g}.", step=step_number)
        return
    tensors = nonfinite_gradients(s)
    detail = f" in {len(tensors)} gradient tensors, e.g. {', '.join(tensors[:3])}" if tensors else ""
    s.run.event("nonfinite", f"Skipped step {step_number}: non-finite {verdict.what} (loss {verdict.loss}, grad norm "
                f"{verdict.grad_norm}){detail}.", step=step_number, what=verdict.what, tensors=tensors[:20],
                paths=list(s.batch_paths))


def take_snapshot(s: Session) -> Snapshot | None:
    """A copy of the adapter and optimizer state to roll back to; None when the weights are not all finite."""
    with torch.no_grad():
        if not torch.isfinite(torch.nn.utils.get_total_norm(s.params)):  # one check, not one sync per tensor
            return None
        return Snapshot(s.state.step, [p.detach().clone() for p in s.params], cloned(s.optimizer.state_dict()))


def cloned(tree: Any) -> Any:
    """A deep copy of an optimizer state dict that clones its tensors: copy.deepcopy does the same at several
    times the cost (it was a millisecond per step of a small run, snapshots every 20 steps)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {key: cloned(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(cloned(value) for value in tree)
    return copy.copy(tree)


def roll_back(s: Session, verdict: RollBack) -> None:
    """Weights and optimizer back to the last good state, and a lower learning rate."""
    if s.snapshot is not None:
        with torch.no_grad():
            for p, saved in zip(s.params, s.snapshot.params):
                p.copy_(saved)
        s.optimizer.load_state_dict(cloned(s.snapshot.optimizer))  # the snapshot stays for a later rollback
        source = f"rolled the LoRA and optimizer back to step {s.snapshot.step} (in memory)"
    elif (checkpoint := latest_good_checkpoint(s.run.paths.checkpoints)) is not None:
        restore_adapter(s, checkpoint.adapter)
        s.optimizer.load_state_dict(checkpoint.state["optimizer"])
        source = f"rolled the LoRA and optimizer back to checkpoint {checkpoint.path.name}"
    else:
        source = "no good state to roll back to (no snapshot, no checkpoint), kept the current weights"
    old, new = s.lr_scheduler.lower(verdict.lr_factor, verdict.min_lr)  # peaks: the rate is ~0 in a warm-up
    s.run.event("rollback", f"{len(verdict.bad_steps)} non-finite steps within {verdict.window} steps (last at step "
                f"{verdict.step}): {source}; learning rate {old:.3g} -> {new:.3g}.", step=verdict.step, old_lr=old,
                new_lr=new, bad_steps=list(verdict.bad_steps), console=True)


def switch_precision(s: Session, precision: str) -> None:
    """Run the rest of the training in `precision` ('bf16' or 'no'): autocast follows and the scaler goes
    (s.amp), and the frozen model is recast. LoRA weights stay fp32 and are not touched."""
    s.amp.switch_to(precision)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    trained = {id(p) for p in s.params}
    for module in (s.bundle.unet, *s.bundle.text_encoders):
        for p in module.parameters():
            if id(p) not in trained and p.dtype != dtype:
                p.data = p.data.to(dtype)
        for b in module.buffers():
            if b.is_floating_point():
                b.data = b.data.to(dtype)
    s.weight_dtype = dtype


def nonfinite_gradients(s: Session) -> list[str]:
    """Names of the trained tensors whose gradient holds NaN or Inf (only computed on a bad step)."""
    names = []
    for prefix, module in s.trained.items():
        for name, p in module.named_parameters():
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                names.append(f"{prefix}.{name}")
    return names


# ---- between steps: signals, samples, the UI's commands -----------------------------------------------------
def learning_summary(scores: dict[str, dict[str, float]]) -> str:
    from ..toy.judge import learning_summary as colours

    return f"Learning summary (validation images showing their colour, first -> last sampling): " \
           f"{colours(scores['first'], scores['last'])}."


def stop_signal(s: Session) -> int | None:
    """The Ctrl-C / SIGTERM the CLI caught, if any; with several processes the main one's, so every rank stops
    at the same step (a rank that stopped alone would leave the others waiting in the next collective)."""
    signum = signals.requested()
    if s.accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        signum = broadcast_object_list([signum])[0]
    return signum


def signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def sample(s: Session, *, then: str = "training") -> None:
    if not s.accelerator.is_main_process:
        return
    s.run.status("sampling", step=s.state.step, max_steps=s.max_steps)
    folder = s.run.paths.sample_dir(s.state.step)
    with evaluation_weights(s.optimizer), optional_swap(s.ema, s.config.validation_with_ema):
        paths = make_validation_images(s.bundle, s.config, folder, s.device, autocast=s.amp.autocast)
    s.run.event("samples", f"Made {len(paths)} validation images at step {s.state.step}.", step=s.state.step)
    if s.tensorboard:
        s.tensorboard.log_images(s.state.step, paths)
    if s.config.sample_judge == "toy_colors" and paths:
        from ..toy.judge import judge_samples

        scores = judge_samples(folder)
        s.sample_scores.setdefault("first", scores)
        s.sample_scores["last"] = scores
        s.run.event("sample_score", "Validation images showing their prompt's colour: " + ", ".join(
            f"{color} {value:.0%}" for color, value in scores.items()) + ".", step=s.state.step, scores=scores)
    s.run.status(then, step=s.state.step, max_steps=s.max_steps)


def sample_now(s: Session, state_after: str) -> None:
    """The UI's "Sample now". Sampling draws from its own seeded generators, never from the training RNG, so
    a run sampled on request still ends bitwise equal to one that was not."""
    if not s.config.validation_prompts:
        s.run.event("samples", "Sample now: this run has no validation prompt, so there is nothing to render "
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
            s.run.event("stop", f"Stop requested at step {s.state.step}; saving and exporting.", step=s.state.step)
            return "stop"
        elif kind == "pause" and not paused:
            paused = True
            s.run.status("paused", step=s.state.step, max_steps=s.max_steps)
            s.run.event("pause", f"Paused at step {s.state.step}.", step=s.state.step)
        elif kind == "resume" and paused:
            s.run.event("resume_run", f"Continuing from step {s.state.step}.", step=s.state.step)
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
    command = s.run.take_control()
    if s.accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        command = broadcast_object_list([command])[0]
    return command