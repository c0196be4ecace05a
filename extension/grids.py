"""The checkpoint comparison grids of a run (RUN/grids/NAME.png, made by `python -m stabletune_core grid`): what
can be compared, starting one in the trainer's Python, how far it is, and the finished ones.

The UI never renders: the grid is a process of its own (it loads the model), like training; this module only
reads RUN/grids/*.json and starts the command with an argv list.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from stabletune_core.atomic import write_text_atomic
from stabletune_core.launch import engine_env
from stabletune_core.runs.layout import RunPaths
from stabletune_core.runs.reader import RunReader, pid_alive

try:  # Python 3.11+; A1111 hosts may run 3.10 with tomli
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - depends on the host
    import tomli as tomllib  # type: ignore[no-redef]

DEFAULT_STRENGTHS = "0, 0.5, 0.75, 1"


def checkpoint_choices(reader: RunReader) -> list[str]:
    """'step 100' per finished checkpoint, oldest first."""
    return [f"step {int(folder.name.split('_')[1])}" for folder in reader.checkpoints()]


def run_seeds(run: Path) -> str:
    """The run's validation seeds as the grid's default ('7, 8')."""
    try:
        with open(RunPaths(run).config, "rb") as f:
            config = tomllib.load(f)
    except (OSError, ValueError):
        return ""
    seed, count = int(config.get("seed", 42)), int(config.get("num_validation_images") or 1)
    return ", ".join(str(seed + i) for i in range(count)) if seed >= 0 else ""


def numbers(text: str, kind: type, what: str) -> tuple[str | None, str | None]:
    """(the numbers as the CLI takes them, None) or (None, one sentence saying what is wrong)."""
    parts = [p.strip() for p in str(text or "").replace(";", ",").split(",") if p.strip()]
    try:
        values = [kind(p) for p in parts]
    except ValueError:
        return None, f"{what} must be {'whole ' if kind is int else ''}numbers separated by commas, e.g. " \
                     f"{'7, 8' if kind is int else DEFAULT_STRENGTHS}; got '{text}'."
    if not values:
        return None, f"{what} is empty; give at least one, e.g. {'7' if kind is int else DEFAULT_STRENGTHS}."
    odd = next((v for v in values if not math.isfinite(v) or (kind is int and v < 0)), None)
    if odd is not None:  # the grid command refuses them too (a NaN strength draws black cells)
        return None, f"{what} holds {odd}; give {'whole numbers from 0 up' if kind is int else 'finite numbers'}, " \
                     f"e.g. {'7, 8' if kind is int else DEFAULT_STRENGTHS}."
    return ",".join(f"{v:g}" for v in values), None


def command(engine_python: str, run: Path, checkpoints: list[str], strengths: str, seeds: str | None,
            name: str) -> list[str]:
    argv = [engine_python, "-m", "stabletune_core", "grid", str(run), "--checkpoints",
            ",".join(c.replace("step ", "") for c in checkpoints), "--strengths", strengths, "--name", name]
    return argv + (["--seeds", seeds] if seeds else [])


def start(engine_python: str, run: Path, checkpoints: list[str], strengths: str, seeds: str) -> str:
    """Start rendering a grid of `run` in its own process; the sentence for the user."""
    if not checkpoints:
        return "⚠ Choose at least one checkpoint to compare."
    strength_list, problem = numbers(strengths, float, "LoRA strengths")
    seed_list, seed_problem = numbers(seeds, int, "Seeds") if str(seeds or "").strip() else (None, None)
    if problem or seed_problem:
        return f"⚠ {problem or seed_problem}"
    name = f"grid-{time.strftime('%Y%m%d-%H%M%S')}"
    folder = RunPaths(run).grids
    folder.mkdir(exist_ok=True)
    with open(folder / f"{name}.log", "ab") as log:
        process = subprocess.Popen(command(engine_python, run, checkpoints, strength_list, seed_list, name),
                                   stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=engine_env(),
                                   start_new_session=True)
    meta = folder / f"{name}.json"
    if not meta.exists():  # until the grid process writes its own (it loads torch first): whose it is
        meta.write_text(json.dumps({"state": "starting", "pid": process.pid}), encoding="utf-8")
    return (f"Rendering **{name}** in its own process ({', '.join(checkpoints)} x strengths {strength_list}); it "
            "appears below when done. A training that runs now is not touched (on a GPU the grid shares its memory).")


def cancel(run: Path) -> str:
    """Ask every grid of `run` still rendering to stop at its next image; the sentence for the user."""
    rendering = [g["name"] for g in grids(run) if g["state"] in ("starting", "rendering")]
    if not rendering:
        return "No grid of this run is rendering."
    for name in rendering:
        write_text_atomic(RunPaths(run).grid_cancel(name), "cancel", durable=False)
    return (f"Cancelling **{', '.join(rendering)}**: it stops at its next image and writes no grid (the run is "
            "untouched).")


def grids(run: Path) -> list[dict[str, Any]]:
    """Every grid of `run`, newest first: its name, state, progress, PNG and error (from RUN/grids/NAME.json; a
    grid refused before it started has only its log, whose `error:` line says why)."""
    folder = RunPaths(run).grids
    found = []
    for log in sorted(folder.glob("*.log"), key=lambda p: p.stat().st_mtime, reverse=True) if folder.is_dir() else []:
        meta, png = log.with_suffix(".json"), log.with_suffix(".png")
        try:
            data = json.loads(meta.read_text(encoding="utf-8")) if meta.is_file() else {}
        except (OSError, ValueError):
            data = {}
        state, error = data.get("state"), data.get("error")
        if state in (None, "starting", "rendering") and not pid_alive(data.get("pid")):
            state, error = "failed", _log_error(log) or "the grid process ended before it finished; see its log"
        found.append({"name": log.stem, "state": state, "done": data.get("done", 0), "total": data.get("total", 0),
                      "error": error, "png": str(png) if png.is_file() and state == "finished" else None,
                      "doing": data.get("doing") or "starting", "seconds_left": data.get("seconds_left")})
    return found


def _log_error(log: Path) -> str | None:
    """The grid command's `error:` sentence, else the message of a traceback's last line."""
    text = log.read_text(encoding="utf-8", errors="replace") if log.is_file() else ""
    said = [line[len("error: "):] for line in text.splitlines() if line.startswith("error: ")]
    if said:
        return said[-1]
    raised = [m.group(1) for m in map(_EXCEPTION.match, text.splitlines()) if m]
    return raised[-1] if raised else None


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception): (.+)$")  # a traceback's last line


def progress_text(run: Path) -> str:
    """One line per grid still rendering or failed; the finished ones are shown as images."""
    lines = []
    for grid in grids(run):
        if grid["state"] in ("starting", "rendering"):
            doing = "starting (Python loads torch, then the model)" if grid["doing"] == "starting" else grid["doing"]
            left = f", about {_duration(grid['seconds_left'])} left" if grid.get("seconds_left") is not None else ""
            lines.append(f"⏳ **{grid['name']}**: {doing} · {grid['done']} of {grid['total']} image rows done{left}. "
                         "**Cancel grid** stops it.")
        elif grid["state"] == "cancelled":
            lines.append(f"✖ **{grid['name']}** was cancelled; no grid was written.")
        elif grid["state"] == "failed":
            lines.append(f"⚠ **{grid['name']}** failed: {grid['error']}")
    return "\n\n".join(lines)
