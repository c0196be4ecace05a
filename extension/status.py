"""The one-line status of a run: state, step, speed, ETA, loss, and the last thing the engine said."""
from __future__ import annotations

from typing import Any

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


def status_line(name: str, status: dict[str, Any], last_event: dict[str, Any] | None) -> str:
    state = status.get("state", "unknown")
    if state == "none":
        return "**No run attached.** Load a preset, choose a dataset and click **Start**, or attach a run in **Runs**."
    step, max_steps = status.get("step") or 0, status.get("max_steps")
    head = f"**{name}**: **{state}**"
    if state == "failed":
        # The engine's one sentence comes first: it says what went wrong and what to do.
        reason = status.get("error") or "the trainer stopped without saying why; see the engine log below"
        head += f": {reason}"
    parts = [head, f"step {step}/{max_steps}" if max_steps else f"step {step}"]
    if state == "paused":  # a paused run has no arrival time; its speed is still worth knowing
        parts.append(speed(status.get("sec_per_step")))
    elif status.get("alive") or state in ("launching", "starting", "loading", "caching", "training", "sampling",
                                          "saving"):
        parts += [speed(status.get("sec_per_step")), f"ETA {duration(status.get('eta_seconds'))}"]
    if isinstance(status.get("loss"), (int, float)):
        parts.append(f"loss {status['loss']:.4g}")
    if status.get("exit_code") is not None:
        parts.append(f"engine exited with code {status['exit_code']}")
    line = " · ".join(parts)
    if status.get("summary") and state in ("finished", "stopped"):
        line += f"\n\n{status['summary']}"  # e.g. the demo's learning summary, scored on its validation images
    if last_event and state != "failed":
        line += f"\n\nLast event: *{last_event.get('kind', '')}* — {last_event.get('message', '')}"
    return line
