"""The one-line status of a run: state, step, speed, ETA, loss, and the last thing the engine said; and what
that line reads from the run folder besides status.json (a stop not acted on yet, validation images being made,
a pause, the learning summary)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .eta import CONTINUE, RESTARTS, paused_now, with_eta
from stabletune_core.runs import events as kinds
from stabletune_core.runs.jsonfiles import read_json
from stabletune_core.runs.layout import RunPaths
from stabletune_core.runs.reader import FINAL_STATES

try:  # Python 3.11+; A1111 hosts may run 3.10 with tomli
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - depends on the host
    import tomli as tomllib  # type: ignore[no-redef]

LEARNING_EVENT = kinds.LEARNING  # the engine's learning summary, also kept in status.json's `summary`


def duration(seconds: Any) -> str:
    try:
        seconds = int(float(seconds))
    except (TypeError, ValueError):
        return "–"
    hours, rest = divmod(max(seconds, 0), 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


def speed(sec_per_step: Any) -> str:
    """it/s above one step a second, s/it below (what users of other trainers read)."""
    try:
        value = float(sec_per_step)
    except (TypeError, ValueError):
        return "–"
    if value <= 0:
        return "–"
    return f"{1 / value:.2f} it/s" if value <= 1 else f"{value:.2f} s/it"


# ---- what the line reads from the run folder ------------------------------------------------------------------
def run_status(hub: Any, run: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(status, events) of `run` as the UI shows it: status.json with the ETA measured from the logged steps,
    plus `paused` (also while a paused run renders Sample now), `stop` (a stop the UI asked for: "requested" until
    the engine takes it, "stopping" while it saves), `images` (validation images made / due while sampling) and
    `summary` (the engine's learning summary, from status.json or its newest `learning` event)."""
    reader = hub.reader(run)
    events = reader.events()
    status = with_eta(hub.status(run), reader.metrics(), events)
    state = status.get("state")
    live = bool(status.get("alive")) and state not in FINAL_STATES
    status["paused"] = state == "paused" or (live and paused_now(events))
    status["stop"] = stop_state(reader.paths.control, events) if live else None
    sampled = status.get("sampling_step", status.get("step"))  # the step-0 images are made while training runs
    status["images"] = images_progress(run, int(sampled or 0)) if live and state == "sampling" else None
    if not status.get("summary"):
        learned = [e for e in events if e.get("kind") == LEARNING_EVENT and e.get("message")]
        if learned and state in ("finished", "stopped"):
            status["summary"] = learned[-1]["message"]
    return status, events


def stop_state(control: Path, events: list[dict[str, Any]]) -> str | None:
    """"requested" while control.json holds a stop the engine has not taken yet, "stopping" once it said it stops
    (it then saves a checkpoint and the LoRA), else None."""
    command = read_json(control) if control.exists() else None
    if isinstance(command, dict) and command.get("command") == "stop":
        return "requested"
    for event in reversed(events):
        if event.get("kind") == kinds.STOP_REQUESTED:
            return "stopping"
        if event.get("kind") in (CONTINUE, *RESTARTS):  # a stop before this belongs to an earlier stretch
            break
    return None


def images_progress(run: Path, step: int) -> tuple[int, int] | None:
    """(made, due) validation images of the sampling at `step`: the run's prompts x images per prompt."""
    try:
        with open(RunPaths(run).config, "rb") as f:
            config = tomllib.load(f)
    except (OSError, ValueError):
        return None
    prompts = [p for p in str(config.get("validation_prompt") or "").split(" | ") if p.strip()]
    due = len(prompts) * int(config.get("num_validation_images") or 1)
    folder = RunPaths(run).sample_dir(step)
    made = len(list(folder.glob("*.png"))) if folder.is_dir() else 0
    return (min(made, due), due) if due else None


# ---- the line --------------------------------------------------------------------------------------------------
def status_line(name: str, status: dict[str, Any], last_event: dict[str, Any] | None) -> str:
    state = status.get("state", "unknown")
    if state == "none":
        return ("**No run attached.** New here? Click **Try the demo** at the top, then **Start training**; or "
                "choose a dataset and a model and click **Start**, or attach a run in **Runs**.")
    step, max_steps = status.get("step") or 0, status.get("max_steps")
    shown = state
    if status.get("paused") and state == "sampling":
        shown = "paused (rendering Sample now)"
    head = f"**{name}**: **{shown}**"
    if state == "failed":
        # The engine's one sentence comes first: it says what went wrong and what to do.
        reason = status.get("error") or "the trainer stopped without saying why; see the engine log below"
        head += f": {reason}"
    parts = [head, f"step {step}/{max_steps}" if max_steps else f"step {step}"]
    images = status.get("images")
    if images:
        parts.append(f"validation images {images[0]}/{images[1]}")
    if status.get("paused") or state == "paused":  # no arrival time while paused; its speed is still worth knowing
        parts.append(speed(status.get("sec_per_step")))
    elif status.get("alive") or state in ("launching", "starting", "loading", "caching", "training", "sampling",
                                          "saving"):
        parts += [speed(status.get("sec_per_step")), f"ETA {duration(status.get('eta_seconds'))}"]
    if isinstance(status.get("loss"), (int, float)):
        parts.append(f"loss {status['loss']:.4g}")
    if status.get("exit_code") is not None:
        parts.append(f"engine exited with code {status['exit_code']}")
    line = " · ".join(parts)
    stop = status.get("stop")
    if stop == "requested":
        busy = " (it is making validation images now)" if state == "sampling" else ""
        line += (f"\n\n⏹ **Stop requested**: waiting for the engine{busy}; it saves a checkpoint and the LoRA, "
                 "then stops.")
    elif stop == "stopping":
        line += "\n\n⏹ **Stopping**: saving a checkpoint and the LoRA."
    if status.get("summary") and state in ("finished", "stopped"):
        line += f"\n\n{status['summary']}"  # e.g. the demo's learning summary, scored on its validation images
    if last_event and state != "failed":
        line += f"\n\nLast event: *{last_event.get('kind', '')}* — {last_event.get('message', '')}"
    return line
