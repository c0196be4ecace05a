"""The engine's side of the run directory."""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

from .jsonfiles import append_jsonl, read_json, write_json_atomic
from .layout import RunPaths


class RunWriter:
    """Writes status, metrics and events. Only the main process writes (others get `enabled=False`)."""

    def __init__(self, root: Path | str, *, enabled: bool = True):
        self.paths = RunPaths(Path(root))
        self.enabled = enabled
        self._status: dict[str, Any] = {}
        self._started = time.time()
        if enabled:
            for folder in (self.paths.root, self.paths.samples, self.paths.checkpoints, self.paths.output,
                           self.paths.diagnostics):
                folder.mkdir(parents=True, exist_ok=True)

    def status(self, state: str, **fields: Any) -> None:
        """The heartbeat: state is one of starting, loading, caching, training, paused, sampling, saving,
        finished, stopped, failed."""
        if not self.enabled:
            return
        self._status.update(fields)
        self._status.update(state=state, pid=os.getpid(), host=socket.gethostname(), updated_at=time.time(),
                            started_at=self._started)
        write_json_atomic(self.paths.status, self._status)

    def metric(self, step: int, **values: Any) -> None:
        if self.enabled:
            append_jsonl(self.paths.metrics, {"step": step, "time": time.time(), **values})

    def event(self, kind: str, message: str, *, step: int | None = None, **data: Any) -> None:
        """A decision the engine took and why, in a sentence a user can read."""
        if self.enabled:
            append_jsonl(self.paths.events, {"time": time.time(), "step": step, "kind": kind, "message": message,
                                             **data})

    def take_control(self) -> dict[str, Any] | None:
        """Commands the UI left in control.json (stop, save, pause, resume); each is consumed once."""
        if not self.enabled or not self.paths.control.exists():
            return None
        command = read_json(self.paths.control)
        try:
            self.paths.control.unlink()
        except FileNotFoundError:
            pass
        return command
