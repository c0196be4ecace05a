"""One live trainer per run folder: an OS lock on the run folder itself.

The trainer (the main process; under accelerate only rank 0) holds an exclusive `fcntl.flock` on the run folder
(a directory can be flocked through a read-only descriptor, so no lock file is added to a folder that may hold
an earlier run the user keeps). The kernel drops the lock when the process ends in any way (an exception,
SIGKILL, an out-of-memory kill), so a dead trainer never leaves its folder locked. A second trainer on the folder,
a fresh start or a `--resume auto`, finds the lock taken and is refused in one sentence naming the live process,
before it writes anything there. The UI writes config.toml into a run folder and then starts the engine on it;
only the engine takes the lock.
"""
from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

from ..config import ConfigError
from .jsonfiles import read_json
from .layout import RunPaths

#: Run folder -> the open descriptor whose lock this process holds.
_HELD: dict[Path, int] = {}
_TAKEN = (errno.EWOULDBLOCK, errno.EAGAIN)


class RunInUse(ConfigError):
    """The run folder belongs to a live trainer; the refused start must not touch its status.json."""


def _key(root: Path | str) -> Path:
    return Path(root).expanduser().resolve()


def _close_in_child() -> None:
    """A forked child (a DataLoader worker) must not keep the lock alive after the trainer is killed."""
    for fd in _HELD.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _holder_pid(folder: Path) -> int | None:
    """The pid holding an flock on `folder`: from /proc/locks on Linux, else the live pid in its status.json."""
    try:
        info = os.stat(folder)
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if "FLOCK" not in fields or "->" in fields:  # '->' marks a process waiting, not holding
                    continue
                major, minor, inode = fields[5].split(":")
                if (int(inode) == info.st_ino and int(major, 16) == os.major(info.st_dev)
                        and int(minor, 16) == os.minor(info.st_dev)):
                    return int(fields[4])
    except (OSError, ValueError, IndexError):
        pass
    from .reader import pid_alive

    pid = (read_json(RunPaths(folder).status) or {}).get("pid")
    return pid if isinstance(pid, int) and pid != os.getpid() and pid_alive(pid) else None


def hold(root: Path | str) -> None:
    """Lock the run folder for this process (creating the folder), or raise RunInUse naming the live trainer.

    Only the main process locks (other ranks of an accelerate launch train the same run). A file system without
    locks (some network mounts) is trained on unlocked, as before."""
    if os.environ.get("RANK", "0") != "0":
        return
    key = _key(root)
    if key in _HELD:
        return
    key.mkdir(parents=True, exist_ok=True)
    fd = os.open(key, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for attempt in range(5):  # `holder` takes a shared lock for an instant: do not mistake it for a trainer
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in _TAKEN or attempt == 4:
                    raise
                time.sleep(0.05)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in _TAKEN:
            return  # no locks here (ENOLCK, EBADF on some network mounts): train unlocked rather than refuse
        pid = _holder_pid(key)
        who = f"trainer process {pid}" if pid else "another trainer process"
        raise RunInUse([f"Run folder {key} is in use by {who}, which is still training there; wait for it to "
                        "end or stop it (Ctrl-C, or Stop in the UI) before starting or resuming this run, or choose "
                        "another --output_dir."]) from None
    _HELD[key] = fd


def release(root: Path | str) -> None:
    """Give the folder back (the end of a run in a process that goes on, e.g. a test or the demo's gallery)."""
    fd = _HELD.pop(_key(root), None)
    if fd is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def holder(root: Path | str) -> int | None:
    """The pid of another live process that holds the folder's lock (-1 when it cannot be told); None when the
    folder is free (or missing) or this process holds it."""
    key = _key(root)
    if key in _HELD or not key.is_dir():
        return None
    try:
        fd = os.open(key, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return (_holder_pid(key) or -1) if exc.errno in _TAKEN else None
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
