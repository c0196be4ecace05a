"""Resumable checkpoints: written whole or not at all, checked by sha256 before they are trusted.

A checkpoint folder holds `adapter.safetensors` (the LoRA weights), `state.pt` (optimizer, scheduler,
scaler, RNGs, counters; tensors and plain containers only, read back with weights_only=True) and
`manifest.json` with the sha256 of each file. It is written under a temporary name, fsynced and renamed,
so a crash or a full disk mid-write leaves the previous checkpoint as the newest complete one.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from ..atomic import fsync_dir, fsync_file, replace, user_permissions
from ..digest import sha256_file
from ..runs.layout import (checkpoint_adapter, checkpoint_manifest, checkpoint_state, checkpoint_temporaries,
                           checkpoint_temporary, step_folders, step_of)
from ..runs.reader import pid_alive


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted, with the reason in one sentence."""

    reason: str = ""  # the bare cause (e.g. "No space left on device") for sentences built around it

    def clause(self) -> str:
        """The message as a clause inside a caller's sentence ("cannot resume: checkpoint ... lacks state.pt"): it
        names the checkpoint folder, so the caller does not name it again."""
        text = str(self).rstrip(".")
        return text[:1].lower() + text[1:]


@dataclass
class Checkpoint:
    path: Path
    step: int
    adapter: dict[str, torch.Tensor]
    state: dict[str, Any]


def estimate_size(adapter: dict[str, torch.Tensor], state: dict[str, Any]) -> int:
    total = sum(t.numel() * t.element_size() for t in adapter.values())
    return total * 4 + (1 << 20)  # adapter + Adam moments + slack


def nothing(step: int) -> None:
    pass


def save_checkpoint(folder: Path, step: int, adapter: dict[str, torch.Tensor], state: dict[str, Any],
                    *, extra_files: dict[str, bytes] | None = None, halfway: Callable[[int], None] = nothing) -> Path:
    """Write `folder` atomically. Raises CheckpointError (and leaves older checkpoints untouched) when the disk
    is full or unwritable. `halfway(step)` runs between the first file and the manifest: where the fault harness
    (faults.py) puts a SIGKILL or a full disk."""
    folder = Path(folder)
    parent = folder.parent
    parent.mkdir(parents=True, exist_ok=True)
    needed = estimate_size(adapter, state)
    free = shutil.disk_usage(parent).free
    if free < needed:  # disk_usage counts f_bavail: only the space this user may write, not root's reserve
        error = CheckpointError(f"Not enough disk space for a checkpoint in {parent}: {free / 2**20:.0f} MB free, "
                                f"about {needed / 2**20:.0f} MB needed; free some space. The last good checkpoint "
                                "is kept.")
        error.reason = f"{free / 2**20:.1f} MB free, about {needed / 2**20:.0f} MB needed"
        raise error
    tmp = checkpoint_temporary(folder, "tmp", os.getpid())
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        save_file({k: v.detach().contiguous().cpu() for k, v in adapter.items()}, checkpoint_adapter(tmp))
        user_permissions(checkpoint_adapter(tmp))
        halfway(step)
        torch.save(state, checkpoint_state(tmp))
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
        files = sorted(p.name for p in tmp.iterdir())
        for name in files:
            fsync_file(tmp / name)
        manifest = {"step": step, "created_at": time.time(), "files": {n: sha256_file(tmp / n) for n in files}}
        with open(checkpoint_manifest(tmp), "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        old = checkpoint_temporary(folder, "old", os.getpid())
        if folder.exists():  # a save at the same step again (e.g. "save now" then stop): swap, then delete
            replace(folder, old)
        replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as a RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, RuntimeError) and "write" not in str(exc) and "space" not in str(exc):
            raise  # not an I/O failure: a bug, not a full disk
        reason = getattr(exc, "strerror", None) or ("No space left on device?" if "file write failed" in str(exc)
                                                     else str(exc).splitlines()[0])
        error = CheckpointError(f"Could not write checkpoint {folder.name} ({reason}); the last good "
                                "checkpoint is kept. Check free disk space and permissions.")
        error.reason = reason
        raise error from exc
    return folder


def verify_checkpoint(folder: Path) -> dict[str, Any]:
    """The manifest, after checking every file's hash. Raises CheckpointError saying what is wrong."""
    manifest_path = checkpoint_manifest(folder)
    if not manifest_path.exists():
        raise CheckpointError(f"Checkpoint {folder} has no {manifest_path.name}: it was never finished.")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"Checkpoint {folder} has an unreadable {manifest_path.name} ({exc}).") from exc
    for name, expected in manifest.get("files", {}).items():
        path = Path(folder) / name
        if not path.exists():
            raise CheckpointError(f"Checkpoint {folder} lacks {name}.")
        if sha256_file(path) != expected:
            raise CheckpointError(f"Checkpoint {folder}: {name} does not match its sha256 (the file is corrupt).")
    return manifest


def load_checkpoint(folder: Path) -> Checkpoint:
    manifest = verify_checkpoint(folder)
    adapter = load_file(checkpoint_adapter(folder))
    state = torch.load(checkpoint_state(folder), map_location="cpu", weights_only=True)
    return Checkpoint(Path(folder), int(manifest["step"]), adapter, state)


def _verifies(folder: Path) -> bool:
    try:
        verify_checkpoint(folder)
        return True
    except CheckpointError:
        return False


def list_checkpoints(parent: Path) -> list[Path]:
    """Checkpoint folders, oldest step first (a folder's manifest says whether it is finished: verify_checkpoint)."""
    return step_folders(parent)


def latest_good_checkpoint(parent: Path, report=lambda message: None) -> Checkpoint | None:
    """The newest checkpoint that verifies; each bad one on the way is reported and skipped (never deleted)."""
    for folder in reversed(list_checkpoints(parent)):
        try:
            return load_checkpoint(folder)
        except (CheckpointError, RuntimeError, OSError, ValueError) as exc:
            report(f"{exc} Falling back to the previous checkpoint.")
    return None


def remove_stale_temporaries(parent: Path) -> list[Path]:
    """Delete half-written checkpoint folders (.tmp_* / .old_*) left by processes that are gone."""
    removed = []
    for folder, pid in checkpoint_temporaries(parent):
        if not pid_alive(pid):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def prune_checkpoints(parent: Path, keep_last: int | None, protect: set[Path] = frozenset()) -> list[Path]:
    """Remove all but the newest `keep_last` checkpoints; those in `protect` (the best) stay on top of them.

    Only checkpoints older than the newest one that verifies are removed, so pruning can never leave a run
    without a good checkpoint."""
    if not keep_last:
        return []
    folders = list_checkpoints(parent)
    keep = {p.resolve() for p in protect}
    newest_good = next((f for f in reversed(folders) if _verifies(f)), None)
    removed = []
    for folder in folders[:-keep_last]:
        if newest_good is None or step_of(folder) >= step_of(newest_good):
            continue
        if folder.resolve() not in keep:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
