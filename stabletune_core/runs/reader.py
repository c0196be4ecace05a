"""The UI's side of the run directory. Reads only; never imports torch."""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .jsonfiles import read_json, read_jsonl, write_json_atomic
from .layout import RunPaths, checkpoint_manifest, step_folders, step_of
from .states import FINAL_STATES, FINISHED, STOPPED, FAILED, UNKNOWN, check_command

ENDED_EARLY = "the trainer process ended before its first checkpoint"
# The last line of a Python traceback: "package.module.SomeError: what went wrong".
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Za-z_]\w*(?:Error|Exception|Stop|Interrupt)): (.+)$")


@dataclass
class RunSummary:
    path: Path
    state: str
    step: int
    max_steps: int | None
    alive: bool
    updated_at: float | None


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); treat it as dead.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def latest_timeline(records: list[dict[str, Any]], into: list[dict[str, Any]] | None = None
                    ) -> list[dict[str, Any]]:
    """metrics.jsonl is append-only: a process that died after step 7 with its newest checkpoint at step 4
    left lines 5..7 behind, and the resumed process writes 5, 6, 7 again. A record whose step is not above
    the previous one starts a new timeline: the lines it supersedes (same step or later) are dropped."""
    kept: list[dict[str, Any]] = [] if into is None else into
    for record in records:
        step = record.get("step")
        if kept and isinstance(step, int) and step <= kept[-1].get("step", -1):
            while kept and kept[-1].get("step", -1) >= step:
                kept.pop()
        kept.append(record)
    return kept


class RunReader:
    """Incremental reads of one run: metrics and events are read from where the last call stopped."""

    def __init__(self, root: Path | str):
        self.paths = RunPaths(Path(root))
        self._metrics: list[dict[str, Any]] = []
        self._metrics_offset = 0
        self._events: list[dict[str, Any]] = []
        self._events_offset = 0

    def status(self) -> dict[str, Any]:
        """status.json plus `alive`, and `stale` when it claimed to run but its process is gone.

        A stale run is reported as `failed` (its state as written stays in `reported_state`) with `error`:
        the engine's own last error, else why it cannot be trusted to be resumable. A finished or stopped
        run carries no error (an old one, e.g. a recovered disk-full, may linger in status.json).
        """
        status = read_json(self.paths.status) or {"state": UNKNOWN}
        state = status.get("state")
        alive = pid_alive(status.get("pid")) and status.get("host", os.uname().nodename) == os.uname().nodename
        status["alive"] = alive and state not in FINAL_STATES
        status["stale"] = state not in FINAL_STATES + (UNKNOWN,) and not alive
        if state in (FINISHED, STOPPED):
            status.pop("error", None)
        elif status["stale"]:
            status.update(state=FAILED, reported_state=state, error=self.ended_reason(status.get("error")))
        elif state == FAILED and not status.get("error"):
            status["error"] = self.ended_reason(None)
        return status

    def ended_reason(self, written: str | None) -> str:
        """One sentence for a run whose engine is gone: its written error, the last error in train.log,
        else whether a checkpoint exists to resume from."""
        reason = written or last_error(self.paths.root)
        if reason:
            return reason
        checkpoints = self.checkpoints()
        if checkpoints:
            return (f"the trainer process ended unexpectedly (killed or crashed); Resume continues from the "
                    f"checkpoint at step {step_of(checkpoints[-1])}")
        return ENDED_EARLY

    def metrics(self) -> list[dict[str, Any]]:
        """One record per step, in step order, across resumes (see `latest_timeline`)."""
        new, self._metrics_offset = read_jsonl(self.paths.metrics, self._metrics_offset)
        latest_timeline(new, into=self._metrics)
        return self._metrics

    def events(self) -> list[dict[str, Any]]:
        new, self._events_offset = read_jsonl(self.paths.events, self._events_offset)
        self._events.extend(new)
        return self._events

    def sample_steps(self) -> list[tuple[int, list[Path]]]:
        """Validation images per step, oldest first; file names keep prompt and seed order."""
        steps = []
        for folder in step_folders(self.paths.samples):
            images = sorted(folder.glob("*.png"))
            if images:
                steps.append((step_of(folder), images))
        return steps

    def checkpoints(self) -> list[Path]:
        """Finished checkpoint folders (their manifest written), oldest first."""
        return [p for p in self.paths.checkpoint_folders() if checkpoint_manifest(p).exists()]

    def loras(self) -> list[Path]:
        return self.paths.loras()

    def diagnostics(self, name: str) -> list[dict[str, Any]]:
        return read_jsonl(self.paths.diagnostics / name)[0]

    def summary(self) -> RunSummary:
        status = self.status()
        return RunSummary(self.paths.root, status.get("state", UNKNOWN), int(status.get("step") or 0),
                          status.get("max_steps"), bool(status.get("alive")), status.get("updated_at"))

    def send(self, command: str, **args: Any) -> None:
        """Ask the engine to stop, save, sample, pause or resume (runs/states.py's CONTROL_COMMANDS); it picks this
        up between steps."""
        check_command(command)
        write_json_atomic(self.paths.control, {"command": command, "time": time.time(), **args})


def list_runs(parent: Path | str) -> list[RunSummary]:
    parent = Path(parent)
    if not parent.is_dir():
        return []
    runs = [RunReader(p).summary() for p in parent.iterdir() if RunPaths(p).status.exists()]
    return sorted(runs, key=lambda r: r.updated_at or 0, reverse=True)


def find_runs(parent: Path | str) -> list[RunSummary]:
    """Like list_runs, but also folders the engine has not written a status to yet (config.toml only):
    a run that died while importing, or one still starting, must be visible to attach to."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    runs = []
    for folder in parent.iterdir():
        paths = RunPaths(folder)
        if paths.status.exists():
            runs.append(RunReader(folder).summary())
        elif paths.config.exists():
            runs.append(RunSummary(folder, UNKNOWN, 0, None, False, paths.config.stat().st_mtime))
    return sorted(runs, key=lambda r: r.updated_at or 0, reverse=True)


def last_error(root: Path | str) -> str | None:
    """The engine's last word on why it stopped, from train.log: an `error: ...` line (the CLI's one
    sentence) or the message of a traceback's final exception line; None when the log has neither."""
    for line in reversed(log_tail(root, lines=60).splitlines()):
        line = line.strip()
        if line.startswith("error: "):
            return line[len("error: "):]
        match = _EXCEPTION_LINE.match(line)
        if match:
            return match.group(2)
    return None


def log_tail(root: Path | str, lines: int = 20) -> str:
    """The last lines of RUN/train.log (the engine's stdout/stderr), read from the end of the file."""
    path = RunPaths(Path(root)).log
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""
    # tqdm redraws with carriage returns; keep only the last state of each line.
    kept = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.rstrip("\n").split("\n")]
    return "\n".join(kept[-lines:])
