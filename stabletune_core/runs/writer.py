"""The engine's side of the run directory."""
from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from .events import CONTROL_IGNORED, EVENT_KINDS
from .jsonfiles import append_jsonl, read_json, write_json_atomic
from .layout import RunPaths
from .states import CONTROL_COMMANDS, FAILED, FINAL_STATES, STOP, check_state


#: What status.json says about a failure; it belongs to the state it was written with.
FAILURE_FIELDS = ("error", "reported_state")


def next_status(previous: dict[str, Any], state: str, fields: dict[str, Any]) -> dict[str, Any]:
    """`previous` with `fields` and `state` written over it. A change to any state but failed drops the old
    failure fields first, so an error the run got past (a full disk that freed up) does not stay in a
    finished run's status; fields given with the new state are kept."""
    status = dict(previous)
    if state != FAILED and state != previous.get("state"):
        for key in FAILURE_FIELDS:
            status.pop(key, None)
    status.update(fields)
    status["state"] = state
    return status


class RunWriter:
    """Writes status, metrics and events. Only the main process writes (others get `enabled=False`)."""

    def __init__(self, root: Path | str, *, enabled: bool = True):
        self.paths = RunPaths(Path(root))
        self.enabled = enabled
        self._status: dict[str, Any] = {}
        self.started_at = time.time()
        if enabled:
            for folder in (self.paths.root, self.paths.samples, self.paths.checkpoints, self.paths.output,
                           self.paths.diagnostics):
                folder.mkdir(parents=True, exist_ok=True)

    def status(self, state: str, **fields: Any) -> None:
        """The heartbeat: `state` is one of runs/states.py's STATES. A run's final state (FINAL_STATES) is written
        durably (fsync); the heartbeat of a live run is rewritten every step and only needs to be atomic: a reader
        already treats a stale or unreadable one as a run that died."""
        check_state(state)
        if not self.enabled:
            return
        self._status = next_status(self._status, state, fields)
        self._status.update(pid=os.getpid(), host=socket.gethostname(), updated_at=time.time(),
                            started_at=self.started_at)
        write_json_atomic(self.paths.status, self._status, durable=state in FINAL_STATES)

    def metric(self, step: int, **values: Any) -> None:
        if self.enabled:
            append_jsonl(self.paths.metrics, {"step": step, "time": time.time(), **values})

    def image_losses(self, record: dict[str, Any]) -> None:
        """One step's per-image losses (tools/image_losses.py `loss_record`), for the doctor's ranking."""
        if self.enabled:
            append_jsonl(self.paths.image_losses, record)

    def event(self, kind: str, message: str, *, step: int | None = None, console: bool = False,
              **data: Any) -> None:
        """A decision the engine took and why, in a sentence a user can read. `kind` is one of events.py's; `console`:
        the user must know it now, so it is also one line on stderr (the UI's Train tab shows train.log)."""
        if kind not in EVENT_KINDS:
            raise ValueError(f"{kind!r} is not an event kind of runs/events.py; add it there or use one of those.")
        if not self.enabled:
            return
        if console:  # tqdm.write keeps a live progress bar below the line instead of gluing the two together
            from tqdm import tqdm

            tqdm.write(f"{kind}: {message}" if step is None else f"{kind} (step {step}): {message}", file=sys.stderr)
        append_jsonl(self.paths.events, {"time": time.time(), "step": step, "kind": kind, "message": message,
                                         **data})

    def stop_waiting(self) -> bool:
        """True while control.json holds a stop the loop has not taken yet (it takes it between steps): read, never
        consumed, so a long sampling can end at its next image (issue 25.4)."""
        if not self.enabled or not self.paths.control.exists():
            return False
        try:
            command = read_json(self.paths.control)
        except ValueError:
            return False
        return isinstance(command, dict) and command.get("command") == STOP

    def take_control(self) -> dict[str, Any] | None:
        """The command the UI left in control.json (one of runs/states.py's CONTROL_COMMANDS), consumed once;
        anything else is ignored with a console line."""
        if not self.enabled or not self.paths.control.exists():
            return None
        try:
            command = read_json(self.paths.control)
        except ValueError:  # bytes that are not UTF-8 (read_json answers None for text that is not JSON)
            command = "bytes that are not text"
        try:
            self.paths.control.unlink()
        except FileNotFoundError:
            pass
        if command is not None and not (isinstance(command, dict) and command.get("command") in CONTROL_COMMANDS):
            self.event(CONTROL_IGNORED, f"Ignored control.json: {str(command)[:60]!r} is not a command (the UI writes "
                       f"{{\"command\": \"stop\"}} and the like: {', '.join(CONTROL_COMMANDS)}).", console=True)
            return None
        return command


def record_outcome(root: Path | str, state: str, sentence: str | None = None, **fields: Any) -> bool:
    """Write the final state of a run (failed / stopped) into RUN/status.json, keeping what this process wrote
    there before (step, max_steps). Used where no RunWriter exists or the failure may have come from it, so
    it never raises: a full disk or a missing folder leaves status.json as it was and returns False."""
    paths = RunPaths(Path(root))
    check_state(state)
    try:
        if not paths.root.is_dir():
            return False
        previous = read_json(paths.status) or {}
        if sentence is not None:
            fields = {**fields, "error": sentence}
        status = next_status(previous if previous.get("pid") == os.getpid() else {}, state, fields)
        status.update(pid=os.getpid(), host=socket.gethostname(), updated_at=time.time())
        status.setdefault("started_at", time.time())
        write_json_atomic(paths.status, status)
        if sentence is not None:
            append_jsonl(paths.events, {"time": time.time(), "step": status.get("step"), "kind": state,
                                        "message": sentence})
        return True
    except OSError:
        return False
