"""Which run the UI watches, and the engine processes this UI started.

Shared by every browser tab of one UI process on purpose: there is one machine and usually one run, and
after a UI restart the newest live run is attached again from its run directory alone.
"""
from __future__ import annotations

import subprocess
import threading
from pathlib import Path
from typing import Any

from stabletune_core.runs.reader import RunReader, RunSummary, find_runs


class RunHub:
    def __init__(self, runs_dir: Path):
        self.runs_dir = Path(runs_dir)
        self.attached: Path | None = None
        self._readers: dict[Path, RunReader] = {}
        self._procs: dict[Path, subprocess.Popen] = {}
        self._lock = threading.Lock()  # Gradio calls handlers from worker threads
        self.announced: set[str] = set()  # queue runs the host was told about (tabs/queue.announce_started)

    def runs(self) -> list[RunSummary]:
        return find_runs(self.runs_dir)

    def reader(self, path: Path | None = None) -> RunReader | None:
        """The cached, incremental reader of `path` (default: the attached run)."""
        path = Path(path) if path else self.attached
        if path is None:
            return None
        with self._lock:
            if path not in self._readers:
                self._readers[path] = RunReader(path)
            return self._readers[path]

    def attach(self, path: Path | str | None) -> None:
        self.attached = Path(path) if path else None

    def attach_default(self) -> Path | None:
        """What a page that chose no run follows: the newest live run (one the queue started, too), else the run
        this UI started or attached last, else the newest run, else nothing. A run whose folder is gone (deleted
        here or by hand) is not followed any more."""
        if self.attached is not None and not self.attached.is_dir():
            self.attached = None
        runs = self.runs()
        live = [r.path for r in runs if r.alive]
        if live and self.attached not in live:
            self.attached = live[0]
        elif self.attached is None and runs:
            self.attached = runs[0].path
        return self.attached

    def started(self, path: Path, process: subprocess.Popen) -> None:
        with self._lock:
            self._procs[Path(path)] = process
            self._readers.pop(Path(path), None)  # a restarted run rewrites its files: read them afresh
        self.attached = Path(path)

    def forget(self, path: Path) -> None:
        """A deleted run: no reader, no process of ours, not the default any more."""
        path = Path(path)
        with self._lock:
            self._readers.pop(path, None)
            self._procs.pop(path, None)
        if self.attached == path:
            self.attached = None

    def status(self, path: Path | None = None) -> dict[str, Any]:
        """status.json plus what only this UI knows: the engine is still importing, or exited early."""
        reader = self.reader(path)
        if reader is None or not reader.paths.root.is_dir():  # nothing attached, or its folder was deleted
            return {"state": "none"}
        status = reader.status()
        process = self._procs.get(reader.paths.root)
        if process is not None:
            code = process.poll()  # also reaps the child, so no zombie outlives it
            if code is None and status.get("state") == "unknown":
                status.update(state="launching", alive=True, pid=process.pid)
            elif code is not None and status.get("state") not in ("failed", "stopped", "finished"):
                status.update(state="failed", alive=False, exit_code=code,
                              error=reader.ended_reason(status.get("error")))
        return status

    def is_live(self, path: Path | None = None) -> bool:
        return bool(self.status(path).get("alive"))
