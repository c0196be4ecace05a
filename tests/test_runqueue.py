"""Issue 25.12: the training queue (stabletune_core/runqueue.py) with real trainer processes on the tiny model:
entries run one after another, a failed run does not stop the queue, waiting entries move and go, one worker and
one trainer at a time, the queue lives in the runs folder (a UI restart finds it) and the CLI adds to it."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stabletune_core import runqueue
from stabletune_core.launch import LaunchError, engine_env
from stabletune_core.runs.layout import RunPaths
from stabletune_core.runs.writer import RunWriter

ROOT = Path(__file__).resolve().parent.parent


def tiny_values(tiny_model: Path, data: Path, **overrides) -> dict:
    values = dict(pretrained_model_name_or_path=str(tiny_model), train_data_dir=str(data), resolution=64,
                  bucket_step=8, min_bucket_reso=32, max_bucket_reso=128, train_batch_size=4, max_train_steps=3,
                  lora_rank=4, save_steps=1000, seed=3, validation_prompt="", validation_loss_every=0)
    values.update(overrides)
    return values


def cli(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stabletune_core", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env={**engine_env(), "OMP_NUM_THREADS": "1"})


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_add_checks_the_config_before_anything_is_queued(tmp_path: Path, tiny_model: Path,
                                                         shapes_dataset: Path) -> None:
    with pytest.raises(LaunchError) as bad:
        runqueue.add(tmp_path, tiny_values(tiny_model, shapes_dataset, lora_rank=0))
    assert bad.value.problems == ["lora_rank is 0 but must be at least 1."]
    with pytest.raises(LaunchError) as missing:
        runqueue.add(tmp_path, tiny_values(tiny_model, tmp_path / "no-such-folder"))
    assert "does not exist" in missing.value.problems[0]
    assert runqueue.read(tmp_path).entries == []
    done = cli("queue", "add", "--runs-dir", str(tmp_path), "--no-start", "--lora_rank", "0",
               "--pretrained_model_name_or_path", str(tiny_model), "--train_data_dir", str(shapes_dataset))
    assert done.returncode == 2 and done.stderr.strip() == "error: lora_rank is 0 but must be at least 1."


def test_waiting_entries_move_and_go_and_a_running_one_stays(tmp_path: Path, tiny_model: Path,
                                                             shapes_dataset: Path) -> None:
    ids = [runqueue.add(tmp_path, tiny_values(tiny_model, shapes_dataset, output_name=name)).id
           for name in ("a", "b", "c")]
    assert [e.name for e in runqueue.read(tmp_path).entries] == ["a-1", "b-2", "c-3"]
    assert [e.id for e in runqueue.move(tmp_path, ids[2], 1)] == [3, 1, 2]
    runqueue.remove(tmp_path, ids[0])
    assert [e.id for e in runqueue.read(tmp_path).waiting()] == [3, 2]
    assert not runqueue.entry_config(tmp_path, ids[0]).exists()
    with runqueue.changing(tmp_path) as queue:
        queue.get(3).state = runqueue.RUNNING
    with pytest.raises(runqueue.QueueError, match="only waiting entries can be removed"):
        runqueue.remove(tmp_path, 3)
    with pytest.raises(runqueue.QueueError, match="only waiting entries can move"):
        runqueue.move(tmp_path, 3, 2)
    with pytest.raises(runqueue.QueueError, match="no entry #9"):
        runqueue.remove(tmp_path, 9)


def test_entries_train_one_after_another_and_a_failed_one_does_not_stop_the_queue(tmp_path: Path, tiny_model: Path,
                                                                                  shapes_dataset: Path) -> None:
    """Three entries (one added by the CLI), the middle one fails in the engine (its LoRA target names no layer):
    the queue trains the first, records the failure with the engine's sentence, trains the third; never two
    trainers at a time, never two workers, and the UI's Start is refused while the queue's trainer trains."""
    runs = tmp_path / "runs"
    first = cli("queue", "add", "--runs-dir", str(runs), "--no-start", "--output_dir", str(runs / "first"),
                *[f"--{k}={v}" for k, v in tiny_values(tiny_model, shapes_dataset).items()])
    assert first.returncode == 0 and first.stdout.startswith("Queued #1 first."), first.stderr
    runqueue.add(runs, tiny_values(tiny_model, shapes_dataset, output_dir=str(runs / "broken"),
                                   unet_lora_targets=["no_such_layer"]))
    runqueue.add(runs, tiny_values(tiny_model, shapes_dataset, output_dir=str(runs / "third")))
    worker = subprocess.Popen([sys.executable, "-m", "stabletune_core", "queue", "run", "--runs-dir", str(runs)],
                              cwd=ROOT, env={**engine_env(), "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: runqueue.worker_alive(runs), 60, "the worker")
        second = cli("queue", "run", "--runs-dir", str(runs), timeout=60)
        assert second.returncode == 0 and "already running" in second.stdout
        wait_for(lambda: runqueue.read(runs).running() is not None, 120, "the first entry to start")
        other = RunPaths(runs / "by-hand")
        other.root.mkdir(parents=True)
        other.config.write_text("")
        with pytest.raises(runqueue.QueueError, match="is still training; one run at a time"):
            runqueue.start_trainer(runs, other.root)
        output, _ = worker.communicate(timeout=400)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert worker.returncode == 0, output
    entries = runqueue.read(runs).entries
    assert [(e.name, e.state) for e in entries] == [("first", "finished"), ("broken", "failed"),
                                                    ("third", "finished")], output
    assert "unet_lora_targets: 'no_such_layer' matches no layer" in entries[1].error
    for before, after in zip(entries, entries[1:]):
        assert before.ended_at <= after.started_at  # one trainer at a time
    assert [Path(e.run).name for e in entries] == ["first", "broken", "third"]
    assert all(list((Path(e.run) / "output").glob("*.safetensors")) for e in (entries[0], entries[2]))
    listed = cli("queue", "list", "--runs-dir", str(runs)).stdout
    assert "#2   failed    broken" in listed and listed.rstrip().endswith("worker: not running; 0 waiting.")


def test_the_queue_survives_a_ui_restart_and_the_page_follows_it(tmp_path: Path, tiny_model: Path,
                                                                 shapes_dataset: Path) -> None:
    """Add to queue in one UI, throw that UI away, build another on the same runs folder: it shows the same
    queue, whose worker (a process of its own) trains the entry to the end; a page that followed the queue's
    run follows the queue on to its next run."""
    from extension.settings import UISettings
    from extension.tabs import queue as queue_tab
    from extension.ui import build_ui, follow_queue
    from ui_tools import raw_form

    runs = tmp_path / "runs"
    first_ui = build_ui(UISettings(runs_dir=runs)).stabletune_context
    raw = raw_form(first_ui, **{k: v for k, v in tiny_values(tiny_model, shapes_dataset).items()},
                   output_dir=str(runs / "queued"))
    message, *_ = queue_tab._enqueue(first_ui, *raw)
    assert message.startswith("Queued #1 **queued**.") and "The queue runs (worker pid" in message, message
    del first_ui
    restarted = build_ui(UISettings(runs_dir=runs)).stabletune_context
    status, table, _ = queue_tab.refresh(restarted, {})
    assert list(table["name"]) == ["queued"] and set(table["state"]) <= {"waiting", "running", "finished"}
    wait_for(lambda: runqueue.read(runs).entries[0].state == "finished", 300, "the queued run to finish")
    status, table, _ = queue_tab.refresh(restarted, {})
    assert list(table["state"]) == ["finished"] and status.startswith("**Queue:** done"), status
    wait_for(lambda: not runqueue.worker_alive(runs), 30, "the worker to end")

    page = {}
    with runqueue.changing(runs) as queue:  # the queue moves on from the run the page watched to the next one
        queue.entries[0].state = runqueue.RUNNING
    assert follow_queue(restarted, page, runs / "queued") == runs / "queued" and page["queue_run"]
    with runqueue.changing(runs) as queue:
        queue.entries[0].state = "finished"
        queue.entries.append(runqueue.Entry(2, "next", runqueue.RUNNING, run=str(runs / "next")))
    assert follow_queue(restarted, page, runs / "queued") == runs / "next"
    assert follow_queue(restarted, page, runs / "queued") == runs / "queued"  # chosen by hand: left alone
    RunWriter(runs / "next").status("stopped", step=1)


def test_queue_tab_moves_removes_and_holds(tmp_path: Path, tiny_model: Path, shapes_dataset: Path) -> None:
    """The Queue tab's buttons on waiting entries, and Hold: the worker then starts nothing (entries keep waiting)."""
    from extension.settings import UISettings
    from extension.tabs import queue as queue_tab
    from extension.ui import build_ui

    runs = tmp_path / "runs"
    ui = build_ui(UISettings(runs_dir=runs)).stabletune_context
    for name in ("a", "b", "c"):
        runqueue.add(runs, tiny_values(tiny_model, shapes_dataset, output_name=name))
    status, table, entry = queue_tab.refresh(ui, {})
    assert entry["choices"] == ["#1 a-1", "#2 b-2", "#3 c-3"] and status.startswith("**Queue:** not running")
    message, chooser = queue_tab._move(ui, "#3 c-3", -1)
    assert message == "Moved #3 c-3 up." and chooser["choices"] == ["#1 a-1", "#3 c-3", "#2 b-2"]
    assert queue_tab._move(ui, "#1 a-1", 1)[1]["choices"] == ["#3 c-3", "#1 a-1", "#2 b-2"]
    message, chooser = queue_tab._remove(ui, "#1 a-1")
    assert message.startswith("Removed #1 **a-1**") and chooser["choices"] == ["#3 c-3", "#2 b-2"]
    assert queue_tab._remove(ui, None)[0] == "Choose a waiting entry first."
    assert queue_tab._hold(ui).startswith("The queue starts nothing")
    said: list[str] = []
    assert runqueue.run_worker(runs, say=said.append) == 0 and said == ["queue: nothing left to start."]
    assert [e.state for e in runqueue.read(runs).entries] == ["waiting", "waiting"]
    assert queue_tab.status_text(ui).startswith("**Queue:** held — click **Run the queue**")
    # A host without pydantic 2 (AUTOMATIC1111) adds through the engine's Python: the same entry, the same checks.
    added = queue_tab._add_through_engine(ui, tiny_values(tiny_model, shapes_dataset, output_name="d"))
    assert added == {"id": 4, "name": "d-4"} and runqueue.read(runs).entries[-1].state == "waiting"
    with pytest.raises(LaunchError) as bad:
        queue_tab._add_through_engine(ui, tiny_values(tiny_model, shapes_dataset, lora_rank=0))
    assert bad.value.problems == ["lora_rank is 0 but must be at least 1."]


def test_a_worker_with_nothing_left_to_start_reads_done(tmp_path: Path, tiny_model: Path,
                                                        shapes_dataset: Path) -> None:
    """The last entry finished and the worker is only exiting: the Queue tab says done (it said 'running, waiting
    for the run that trains now to end' while nothing trained); with an entry waiting, an alive worker waits."""
    from extension.settings import UISettings
    from extension.tabs import queue as queue_tab
    from extension.ui import build_ui

    runs = tmp_path / "runs"
    ui = build_ui(UISettings(runs_dir=runs)).stabletune_context
    first = runqueue.add(runs, tiny_values(tiny_model, shapes_dataset, output_name="a"))
    with runqueue.changing(runs) as queue:
        queue.get(first.id).state = "finished"
    with runqueue.locked(runqueue.folder(runs) / "worker.lock"):  # a worker that has not exited yet
        assert runqueue.worker_alive(runs)
        assert queue_tab.status_text(ui) == "**Queue:** done · 0 waiting · 1 done"
        runqueue.add(runs, tiny_values(tiny_model, shapes_dataset, output_name="b"))
        assert queue_tab.status_text(ui).startswith("**Queue:** running (waiting for the run that trains now to end)")
