"""Issue 14.4: one atomic writer for every file and folder the engine replaces; issue 12.3: status.json drops
an old failure when the run moves on."""
from __future__ import annotations

import ast
import json
import os
import stat
import time
from pathlib import Path

import pytest

from stabletune_core.atomic import atomic_path, write_bytes_atomic, write_text_atomic
from stabletune_core.runs.writer import RunWriter, record_outcome

CORE = Path(__file__).resolve().parent.parent / "stabletune_core"


def _renames(tree: ast.AST) -> list[int]:
    """Lines that call os.replace / os.rename, or import them bare."""
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in ("replace", "rename")
                and isinstance(node.value, ast.Name) and node.value.id == "os"):
            lines.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            lines += [node.lineno for alias in node.names if alias.name in ("replace", "rename")]
    return lines


def test_only_the_atomic_module_renames_files_into_place():
    found = {}
    for path in sorted(CORE.rglob("*.py")):
        lines = _renames(ast.parse(path.read_text(encoding="utf-8")))
        if lines:
            found[str(path.relative_to(CORE))] = lines
    assert found.keys() == {"atomic.py"}, found


def test_a_crash_mid_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path):
    target = tmp_path / "status.json"
    write_text_atomic(target, "old")
    with pytest.raises(RuntimeError, match="crash"):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"half of the n")
            raise RuntimeError("crash")
    assert target.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["status.json"]


def test_a_crash_while_staging_a_folder_keeps_the_old_folder_and_leaves_no_temporary(tmp_path: Path):
    target = tmp_path / "dataset"
    with atomic_path(target, folder=True) as staging:
        (staging / "a.txt").write_text("first")
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(target, folder=True) as staging:
            (staging / "sub").mkdir()
            (staging / "sub" / "b.txt").write_text("second")
            raise KeyboardInterrupt
    assert [p.name for p in target.iterdir()] == ["a.txt"] and (target / "a.txt").read_text() == "first"
    assert sorted(os.listdir(tmp_path)) == ["dataset"]


def test_written_files_replace_the_old_ones_with_the_users_permissions(tmp_path: Path):
    target = tmp_path / "caption.txt"
    old_mask = os.umask(0o027)
    try:
        write_bytes_atomic(target, b"one")
        write_text_atomic(target, "tw\u00f6\n")
    finally:
        os.umask(old_mask)
    assert target.read_bytes() == "tw\u00f6\n".encode()
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # not the 0600 of a temporary file
    assert os.listdir(tmp_path) == ["caption.txt"]


def test_a_missing_folder_is_not_made_again(tmp_path: Path):
    """A run folder deleted under a live run must not come back as a folder with only status.json."""
    with pytest.raises(FileNotFoundError):
        write_text_atomic(tmp_path / "deleted-run" / "status.json", "{}")
    assert not (tmp_path / "deleted-run").exists()


# ---- status.json: failure fields belong to the state they were written with ---------------------------
def _written(writer: RunWriter) -> dict:
    return json.loads(writer.paths.status.read_text())


def test_an_old_error_does_not_survive_into_a_later_state(tmp_path: Path):
    writer = RunWriter(tmp_path / "run")
    writer.status("training", step=4, max_steps=10, error="Could not write checkpoint step_000004 (disk full).")
    writer.status("training", step=5, max_steps=10)  # the same state: the warning stands
    assert _written(writer)["error"].startswith("Could not write checkpoint")
    writer.status("finished", step=10, max_steps=10, lora="out.safetensors")
    written = _written(writer)
    assert written["state"] == "finished" and "error" not in written
    assert written["step"] == 10 and written["lora"] == "out.safetensors"


def test_a_failure_keeps_its_error_and_a_new_state_may_bring_its_own(tmp_path: Path):
    writer = RunWriter(tmp_path / "run")
    writer.status("training", step=2, error="first")
    writer.status("failed", step=2, error="Out of memory at step 2.")
    assert _written(writer)["error"] == "Out of memory at step 2."
    writer.status("stopped", step=2, error="Stopped by a second SIGINT.")
    assert _written(writer)["error"] == "Stopped by a second SIGINT."


def test_record_outcome_drops_an_old_error_of_its_own_run(tmp_path: Path):
    writer = RunWriter(tmp_path / "run")
    writer.status("training", step=3, max_steps=10, error="disk full at step 3")
    assert record_outcome(writer.paths.root, "stopped")
    written = _written(writer)
    assert written["state"] == "stopped" and "error" not in written and written["step"] == 3
    assert record_outcome(writer.paths.root, "failed", "The trainer died.")
    assert _written(writer)["error"] == "The trainer died."


# ---- the heartbeat: atomic, not durable (issue 14.6, bench (b)) ----------------------------------------------
def test_the_training_heartbeat_skips_fsync_and_the_final_state_does_not(tmp_path: Path, monkeypatch):
    """status.json is rewritten every few steps: an fsync of the file and its folder cost a small run's step
    more than all its guards (bench/RESULTS.md). Readers still see a whole file; the state a run ends in is
    written durably."""
    from stabletune_core.runs.reader import RunReader

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    writer = RunWriter(tmp_path)
    for step in range(1, 4):
        writer.status("training", step=step)
        assert RunReader(tmp_path).status()["step"] == step
    assert synced == []
    writer.status("finished", step=3)
    assert len(synced) == 2  # the file, then the folder's entry
    assert RunReader(tmp_path).status()["state"] == "finished"


def test_the_loop_writes_the_heartbeat_at_most_twice_a_second_and_always_at_the_end(tiny_config, monkeypatch):
    from stabletune_core.train import loop

    written = []
    real_status = RunWriter.status
    monkeypatch.setattr(RunWriter, "status", lambda self, state, **f: (written.append((time.perf_counter(), state,
                                                                                        f.get("step"))),
                                                                       real_status(self, state, **f)))
    config = tiny_config(max_train_steps=12, logging_steps=1)
    loop.train(config)
    beats = [(t, step) for t, state, step in written if state == "training" and step]
    assert beats[-1][1] == 12  # the last step is always told
    gaps = [b[0] - a[0] for a, b in zip(beats, beats[1:-1])]
    assert all(gap >= loop.HEARTBEAT_SECONDS * 0.99 for gap in gaps), gaps
    assert len(beats) < 12  # fewer writes than steps on this fast model
