"""The words status.json and control.json may hold: the run's states and the UI's commands, spelled once.

The writer refuses a state that is not here and the reader refuses to send a command that is not here, so the
engine and the UI can never drift apart on a word (a typo would otherwise be a state no UI knows how to show, or
a command the loop silently ignores)."""
from __future__ import annotations

# ---- status.json "state" -----------------------------------------------------------------------------------------
STARTING = "starting"  # the process is up, the config checked
LOADING = "loading"  # the model is loading
CACHING = "caching"  # latents / text embeddings are being cached
TRAINING = "training"
PAUSED = "paused"  # the UI's pause: waiting for resume or stop
SAMPLING = "sampling"  # making validation images
SAVING = "saving"  # writing a checkpoint
FINISHED = "finished"
STOPPED = "stopped"  # a signal, the UI or early stopping, after a last checkpoint and the LoRA
FAILED = "failed"  # with one sentence in "error"

#: Every state the engine writes.
STATES = (STARTING, LOADING, CACHING, TRAINING, PAUSED, SAMPLING, SAVING, FINISHED, STOPPED, FAILED)
#: States a run ends in: written durably, and a reader never calls a run in one of them alive.
FINAL_STATES = (FINISHED, STOPPED, FAILED)
#: What the reader says when there is no status.json (yet) to read; never written.
UNKNOWN = "unknown"

# ---- control.json "command" --------------------------------------------------------------------------------------
STOP = "stop"
SAVE = "save"  # a checkpoint now
SAMPLE = "sample"  # validation images now
PAUSE = "pause"
RESUME = "resume"  # continue after a pause (not --resume, which continues a run from its checkpoint)

#: Every command the UI may leave for the loop, which acts on it between steps.
CONTROL_COMMANDS = (STOP, SAVE, SAMPLE, PAUSE, RESUME)


def check_state(state: str) -> str:
    """`state` when it is one of STATES; a ValueError naming the known ones otherwise (a bug, not user input)."""
    if state not in STATES:
        raise ValueError(f"{state!r} is not a run state of runs/states.py ({', '.join(STATES)}).")
    return state


def check_command(command: str) -> str:
    """`command` when it is one of CONTROL_COMMANDS; a ValueError naming the known ones otherwise."""
    if command not in CONTROL_COMMANDS:
        raise ValueError(f"{command!r} is not a control command of runs/states.py ({', '.join(CONTROL_COMMANDS)}).")
    return command
