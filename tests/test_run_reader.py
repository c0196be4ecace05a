"""The UI's side of the run directory: incremental reads, liveness, samples, checkpoints, commands."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from stabletune_core.runs.jsonfiles import append_jsonl, read_jsonl, write_json_atomic, write_text_atomic
from stabletune_core.runs.layout import RunPaths
from stabletune_core.runs.reader import (ENDED_EARLY, RunReader, find_runs, last_error, list_runs, log_tail,
                                         pid_alive)
from stabletune_core.runs.writer import RunWriter


def make_run(root: Path, state: str = "training", pid: int | None = None, **status) -> RunWriter:
    writer = RunWriter(root)
    writer.status(state, step=status.pop("step", 3), max_steps=10, **status)
    if pid is not None:  # pretend another process owns the run
        data = json.loads(writer.paths.status.read_text())
        data["pid"] = pid
        write_json_atomic(writer.paths.status, data)
    return writer


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_metrics_are_read_incrementally_and_half_lines_wait(tmp_path: Path) -> None:
    writer = make_run(tmp_path / "run")
    reader = RunReader(writer.paths.root)
    assert reader.metrics() == []
    writer.metric(1, loss=0.5)
    writer.metric(2, loss=0.4)
    assert [m["step"] for m in reader.metrics()] == [1, 2]
    # A writer caught mid-line: the fragment is not parsed until its newline arrives.
    with open(writer.paths.metrics, "ab") as f:
        f.write(b'{"step": 3, "loss"')
    assert [m["step"] for m in reader.metrics()] == [1, 2]
    with open(writer.paths.metrics, "ab") as f:
        f.write(b': 0.3}\n')
    assert [m["step"] for m in reader.metrics()] == [1, 2, 3]
    assert reader.metrics()[-1]["loss"] == 0.3


def test_non_finite_values_survive_as_strings(tmp_path: Path) -> None:
    writer = make_run(tmp_path / "run")
    writer.metric(1, loss=float("nan"), grad_norm=float("inf"))
    record = RunReader(writer.paths.root).metrics()[0]
    assert record["loss"] == "nan" and record["grad_norm"] == "inf"


def test_events_and_corrupt_lines(tmp_path: Path) -> None:
    writer = make_run(tmp_path / "run")
    writer.event("checkpoint", "Saved checkpoint at step 2.", step=2)
    with open(writer.paths.events, "ab") as f:
        f.write(b"not json\n")
    writer.event("nonfinite", "Skipped step 3.", step=3)
    assert [e["kind"] for e in RunReader(writer.paths.root).events()] == ["checkpoint", "nonfinite"]


def test_status_alive_for_own_process_and_stale_for_dead_one(tmp_path: Path) -> None:
    live = make_run(tmp_path / "live")
    status = RunReader(live.paths.root).status()
    assert status["alive"] and not status["stale"]

    gone = make_run(tmp_path / "gone", pid=dead_pid())
    status = RunReader(gone.paths.root).status()
    assert not status["alive"] and status["stale"] and status["state"] == "failed"

    done = make_run(tmp_path / "done", state="finished", pid=dead_pid())
    status = RunReader(done.paths.root).status()
    assert not status["alive"] and not status["stale"]

    assert RunReader(tmp_path / "missing").status()["state"] == "unknown"


def test_a_dead_run_is_failed_with_a_reason_and_finished_runs_drop_old_errors(tmp_path: Path) -> None:
    """Issue 12.2/3: stale means failed, with the engine's last error, else the checkpoint to resume from,
    else that it ended before its first checkpoint; an old error does not survive into `finished`."""
    early = make_run(tmp_path / "early", state="loading", pid=dead_pid())
    status = RunReader(early.paths.root).status()
    assert status["state"] == "failed" and status["stale"] and status["reported_state"] == "loading"
    assert status["error"] == ENDED_EARLY

    said = make_run(tmp_path / "said", pid=dead_pid(), error="Only 12 MB free on /tmp; free some space.")
    assert RunReader(said.paths.root).status()["error"] == "Only 12 MB free on /tmp; free some space."

    logged = make_run(tmp_path / "logged", pid=dead_pid())
    write_text_atomic(logged.paths.log, "step 3\nerror: Model /m does not exist; point it at a checkpoint.\n")
    assert last_error(logged.paths.root) == "Model /m does not exist; point it at a checkpoint."
    assert RunReader(logged.paths.root).status()["error"] == "Model /m does not exist; point it at a checkpoint."

    killed = make_run(tmp_path / "killed", step=7, pid=dead_pid())
    (killed.paths.checkpoints / "step_000005").mkdir()
    (killed.paths.checkpoints / "step_000005" / "manifest.json").write_text("{}")
    assert "Resume continues from the checkpoint at step 5" in RunReader(killed.paths.root).status()["error"]

    done = make_run(tmp_path / "done", state="finished", pid=dead_pid(), error="disk full at step 4")
    status = RunReader(done.paths.root).status()
    assert status["state"] == "finished" and "error" not in status
    assert RunReader(tmp_path / "missing").status() == {"state": "unknown", "alive": False, "stale": False}


def test_pid_alive() -> None:
    assert pid_alive(os.getpid())
    assert not pid_alive(None)
    assert not pid_alive(dead_pid())


def test_samples_checkpoints_loras_diagnostics(tmp_path: Path) -> None:
    writer = make_run(tmp_path / "run")
    paths = writer.paths
    for step in (40, 80):
        folder = paths.sample_dir(step)
        folder.mkdir(parents=True)
        for name in ("p00_s42.png", "p01_s42.png"):
            (folder / name).write_bytes(b"png")
    paths.sample_dir(120).mkdir()  # a step whose images are still being made: not listed
    paths.checkpoint(40).mkdir(parents=True)
    (paths.checkpoint(40) / "manifest.json").write_text("{}")
    paths.checkpoint(80).mkdir()  # no manifest yet: a checkpoint being written is not offered
    (paths.output / "a.safetensors").write_bytes(b"x")
    append_jsonl(paths.diagnostics / "spectra.jsonl", {"step": 40, "module": "m", "singular_values": [1.0]})

    reader = RunReader(paths.root)
    assert [(s, [p.name for p in imgs]) for s, imgs in reader.sample_steps()] == [
        (40, ["p00_s42.png", "p01_s42.png"]), (80, ["p00_s42.png", "p01_s42.png"])]
    assert [p.name for p in reader.checkpoints()] == ["step_000040"]
    assert [p.name for p in reader.loras()] == ["a.safetensors"]
    assert reader.diagnostics("spectra.jsonl")[0]["module"] == "m"
    assert reader.diagnostics("missing.jsonl") == []


def test_send_writes_a_command_the_writer_consumes_once(tmp_path: Path) -> None:
    writer = make_run(tmp_path / "run")
    RunReader(writer.paths.root).send("stop")
    assert writer.take_control()["command"] == "stop"
    assert writer.take_control() is None


def test_list_runs_and_find_runs(tmp_path: Path) -> None:
    make_run(tmp_path / "older", state="finished")
    time.sleep(0.01)
    make_run(tmp_path / "newer")
    unstarted = RunPaths(tmp_path / "unstarted")
    unstarted.root.mkdir()
    unstarted.config.write_text("seed = 1\n")
    (tmp_path / "not-a-run").mkdir()

    assert [r.path.name for r in list_runs(tmp_path)] == ["newer", "older"]
    found = {r.path.name: r for r in find_runs(tmp_path)}
    assert set(found) == {"newer", "older", "unstarted"}
    assert found["unstarted"].state == "unknown" and not found["unstarted"].alive
    assert found["newer"].alive and found["newer"].step == 3
    assert find_runs(tmp_path / "nowhere") == [] == list_runs(tmp_path / "nowhere")


def test_log_tail_keeps_last_lines_and_last_progress_state(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    paths.log.write_text("".join(f"line {i}\n" for i in range(100)) + "step 1\rstep 2\rstep 3\n")
    tail = log_tail(tmp_path, lines=3)
    assert tail.splitlines() == ["line 98", "line 99", "step 3"]
    assert log_tail(tmp_path / "missing") == ""


def test_jsonl_offsets_and_atomic_text(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    append_jsonl(path, {"a": 1})
    records, offset = read_jsonl(path)
    append_jsonl(path, {"a": 2})
    assert read_jsonl(path, offset)[0] == [{"a": 2}] and records == [{"a": 1}]
    write_text_atomic(tmp_path / "cap.txt", "a red circle\n")
    assert (tmp_path / "cap.txt").read_text() == "a red circle\n"
    assert [p.name for p in tmp_path.iterdir()] and not list(tmp_path.glob(".*.tmp"))
