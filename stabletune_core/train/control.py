"""The UI's commands (RUN/control.json: runs/states.py's CONTROL_COMMANDS), obeyed between steps.

The loop hands in what a command may do (save a checkpoint, make the validation images) as functions; this module
only reads the commands, keeps the pause and says what it did. Every process gets the same command (the main one
reads the file), so no rank trains on, or waits in a save, while the main one stops.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from ..runs import events
from ..runs.states import PAUSE, PAUSED, RESUME, SAMPLE, SAVE, STOP, TRAINING
from ..runs.writer import RunWriter
from . import signals
from .ranks import Ranks

PAUSE_POLL_SECONDS = 0.5  # a paused run reads control.json (and rewrites its heartbeat) this often


def take_command(run: RunWriter, ranks: Ranks) -> dict[str, Any] | None:
    """The main process reads control.json; with several processes every rank gets the same command."""
    return ranks.from_main(run.take_control())


def obey_control(run: RunWriter, ranks: Ranks, *, step: int, max_steps: int, save: Callable[[], Any],
                 sample: Callable[[str], Any] | None) -> bool:
    """Save, sample, stop, pause (then wait for resume or stop). `sample(state_after)`: the images, then the status
    says `state_after`; None for a run without a validation prompt (one sentence says there is nothing to render).
    Returns True when the run is to stop."""
    command = take_command(run, ranks)
    paused = False
    while command or paused:
        kind = (command or {}).get("command")
        if kind == SAVE:
            save()
        elif kind == SAMPLE and sample is None:
            run.event(events.SAMPLES, "Sample now: this run has no validation prompt, so there is nothing to render "
                      "(set validation_prompt for the next run).", step=step, console=True)
        elif kind == SAMPLE:
            sample(PAUSED if paused else TRAINING)
        elif kind == STOP:
            run.event(events.STOP_REQUESTED, f"Stop requested at step {step}; saving and exporting.", step=step)
            return True
        elif kind == PAUSE and not paused:
            paused = True
            run.status(PAUSED, step=step, max_steps=max_steps)
            run.event(events.PAUSED, f"Paused at step {step}.", step=step)
        elif kind == RESUME and paused:
            run.event(events.UNPAUSED, f"Continuing from step {step}.", step=step)
            run.status(TRAINING, step=step, max_steps=max_steps)
            return False
        if paused:
            time.sleep(PAUSE_POLL_SECONDS)
            run.status(PAUSED, step=step, max_steps=max_steps)  # keep the heartbeat fresh
        command = take_command(run, ranks)
    return False


def honour_stop_while_sampling(run: RunWriter, step: int, sampling_step: int) -> None:
    """A stop asked for while the end of a run made its deferred validation images: acted on here (the command is
    taken, the signal marked honoured), so a later resume does not find it."""
    run.take_control()
    if signals.ACTIVE is not None and signals.requested():
        signals.ACTIVE.honoured = True
    run.event(events.STOP_REQUESTED, f"Stop requested at step {step} while making the step-{sampling_step} "
              "validation images; saving and exporting.", step=step)
