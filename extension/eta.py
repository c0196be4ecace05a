"""Speed and ETA of a run from its logged steps, not counting the time it spent paused.

The engine's own `sec_per_step` is a moving average of wall time between steps, so the first step after a
ten-minute pause counts as a ten-minute step and the ETA jumps to hours, then decays over dozens of
steps. Here the speed is the active time over the last logged steps: the paused stretches (a `pause`
event to the next `resume_run`) are subtracted, and an interval that spans an engine restart (`resumed`
from a checkpoint) is left out, since model loading is not training time. Sampling and checkpoint saving
stay in: they recur, so the ETA should include them.
"""
from __future__ import annotations

import math
import time
from typing import Any

from stabletune_core.runs import events as kinds

WINDOW = 20  # logged intervals the speed is measured over: long enough to smooth, short enough to follow
PAUSE, CONTINUE = kinds.PAUSED, kinds.UNPAUSED
# a new engine process took over from a checkpoint (or found none)
RESTARTS = (kinds.RESUMED_FROM_CHECKPOINT, kinds.NOTHING_TO_RESUME)


def paused_spans(events: list[dict[str, Any]], now: float | None = None) -> list[tuple[float, float]]:
    """(start, end) times of every pause; one still going ends `now`."""
    spans, start = [], None
    for event in events:
        kind, at = event.get("kind"), event.get("time")
        if not isinstance(at, (int, float)):
            continue
        if kind == PAUSE and start is None:
            start = at
        elif kind in (CONTINUE, *RESTARTS) and start is not None:
            spans.append((start, at))
            start = None
    if start is not None:
        spans.append((start, time.time() if now is None else now))
    return spans


def paused_now(events: list[dict[str, Any]]) -> bool:
    """Is the run inside a pause (a `pause` with no `unpaused` or restart after it)? A paused run that
    renders "Sample now" reports the state `sampling`, and is still paused."""
    for event in reversed(events):
        if event.get("kind") == PAUSE:
            return True
        if event.get("kind") in (CONTINUE, *RESTARTS):
            return False
    return False


def _overlap(spans: list[tuple[float, float]], start: float, end: float) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans)


def active_seconds_per_step(metrics: list[dict[str, Any]], events: list[dict[str, Any]],
                            window: int = WINDOW) -> float | None:
    """Seconds per step over the last `window` logged intervals, paused time and restarts left out; None
    when fewer than one usable interval is logged."""
    points = [(m["step"], m["time"]) for m in metrics
              if isinstance(m.get("step"), int) and isinstance(m.get("time"), (int, float))]
    points = points[-(window + 1):]
    if len(points) < 2:
        return None
    spans = paused_spans(events, now=points[-1][1])
    restarts = [e["time"] for e in events if e.get("kind") in RESTARTS and isinstance(e.get("time"), (int, float))]
    seconds, steps = 0.0, 0
    for (step0, time0), (step1, time1) in zip(points, points[1:]):
        if step1 <= step0 or time1 < time0 or any(time0 < t <= time1 for t in restarts):
            continue
        seconds += max(0.0, time1 - time0 - _overlap(spans, time0, time1))
        steps += step1 - step0
    if steps == 0 or seconds <= 0 or not math.isfinite(seconds):
        return None
    return seconds / steps


def with_eta(status: dict[str, Any], metrics: list[dict[str, Any]], events: list[dict[str, Any]]) -> dict[str, Any]:
    """`status` with `sec_per_step` and `eta_seconds` measured from the logged steps where they can be
    (else the engine's own values stay)."""
    rate = active_seconds_per_step(metrics, events)
    max_steps, step = status.get("max_steps"), status.get("step") or 0
    if rate is None or not isinstance(max_steps, (int, float)):
        return status
    return {**status, "sec_per_step": rate, "eta_seconds": rate * max(float(max_steps) - float(step), 0.0)}
