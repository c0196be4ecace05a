"""Issue 37.6 and 37.10: the queue keeps what it was told. Hold holds when a run is added (the background worker
`queue add` starts no longer clears it); a damaged queue.json is refused in one sentence and kept, never read as
an empty queue that the next change overwrites; Ctrl-C of `queue run` stops its trainer as the UI's Stop does and
records the entry as it ended."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stabletune_core import runqueue
from stabletune_core.launch import engine_env
from stabletune_core.runs.jsonfiles import read_json
from stabletune_core.runs.layout import RunPaths
from stabletune_core.runs.reader import pid_alive
from test_runqueue import ROOT, cli, tiny_values, wait_for

DAMAGED = {
    "truncated": b'{"entries": [{"id": 1, "name": "a-1", "state": "waiting"}, {"id": 2, "na',
    "emptied to a list": b"[]",
    "random bytes": bytes(range(256)) * 4,
    "an entry without an id": b'{"entries": [{"name": "a-1", "state": "waiting"}], "hold": false, "next_id": 2}',
}


@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_a_damaged_queue_file_is_refused_in_one_sentence_and_kept(damage: str, tmp_path: Path, tiny_model: Path,
                                                                  shapes_dataset: Path) -> None:
    runs = tmp_path / "runs"
    queue_file = runqueue.folder(runs) / "queue.json"
    queue_file.parent.mkdir(parents=True)
    queue_file.write_bytes(DAMAGED[damage])
    flags = [f"--{k}={v}" for k, v in tiny_values(tiny_model, shapes_dataset).items()]
    for command in (["list"], ["add", "--no-start", *flags], ["hold"], ["run"], ["remove", "1"]):
        done = cli("queue", *command, "--runs-dir", str(runs), timeout=120)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, (command, done.stdout, done.stderr)
        assert lines[0].startswith(f"error: The queue file {queue_file} is damaged, so nothing was changed; rename "
                                   "it") and len(lines[0]) < 300 + len(str(queue_file)), lines[0]
        assert "internal error" not in done.stderr and "The queue is empty" not in done.stdout
        assert queue_file.read_bytes() == DAMAGED[damage], command  # never overwritten
    assert not runqueue.entry_config(runs, 1).exists()

    from extension.settings import UISettings
    from extension.tabs import queue as queue_tab
    from extension.ui import build_ui

    ui = build_ui(UISettings(runs_dir=runs)).stabletune_context
    status, table, _ = queue_tab.refresh(ui, {})  # the page's tick shows the sentence instead of failing
    assert status.startswith("**Queue:** ⚠ The queue file") and table.empty
    assert queue_tab._hold(ui).startswith("⚠ The queue file") and queue_tab._run(ui).startswith("⚠ The queue file")
    assert queue_file.read_bytes() == DAMAGED[damage]


def test_adding_to_a_held_queue_starts_nothing(tmp_path: Path, tiny_model: Path, shapes_dataset: Path) -> None:
    """Hold, then Add to queue (CLI and UI): no worker starts, the entries wait, Hold stays; the worker a
    background start runs (`queue run --keep-hold`) ends at once on a held queue; the user's `queue run`
    continues it."""
    from extension.settings import UISettings
    from extension.tabs import queue as queue_tab
    from extension.ui import build_ui
    from ui_tools import raw_form

    runs = tmp_path / "runs"
    runqueue.add(runs, tiny_values(tiny_model, shapes_dataset, output_name="first"))
    runqueue.set_hold(runs, True)
    added = cli("queue", "add", "--runs-dir", str(runs), "--name", "second",
                *[f"--{k}={v}" for k, v in tiny_values(tiny_model, shapes_dataset).items()])
    assert added.returncode == 0, added.stderr
    assert added.stdout.splitlines() == ["Queued #2 second.", runqueue.HELD_NOTE]
    ui = build_ui(UISettings(runs_dir=runs)).stabletune_context
    message, *_ = queue_tab._enqueue(ui, *raw_form(ui, **tiny_values(tiny_model, shapes_dataset, output_name="ui")))
    assert message.startswith("Queued #3 **ui-3**.") and runqueue.HELD_NOTE in message, message
    assert not runqueue.worker_alive(runs)
    background = cli("queue", "run", "--keep-hold", "--runs-dir", str(runs), timeout=120)
    assert background.returncode == 0 and background.stdout.strip() == "queue: nothing left to start."
    queue = runqueue.read(runs)
    assert queue.hold and [e.state for e in queue.entries] == ["waiting"] * 3
    assert not any(p.name != ".queue" for p in runs.iterdir())  # no run folder was made
    assert queue_tab.status_text(ui).startswith("**Queue:** held")


def test_ctrl_c_of_queue_run_stops_its_trainer_with_a_checkpoint(tmp_path: Path, tiny_model: Path,
                                                                 shapes_dataset: Path) -> None:
    """The trainer lives in a session of its own, so a Ctrl-C of the worker never reached it: it trained on while
    the worker said "nothing was written" and the entry stayed `running`. Now the worker asks it to stop as the
    UI's Stop does, waits for its checkpoint, records the entry `stopped` and holds the queue."""
    runs = tmp_path / "runs"
    runqueue.add(runs, tiny_values(tiny_model, shapes_dataset, output_name="long", max_train_steps=5000))
    runqueue.add(runs, tiny_values(tiny_model, shapes_dataset, output_name="next"))
    worker = subprocess.Popen([sys.executable, "-m", "stabletune_core", "queue", "run", "--runs-dir", str(runs)],
                              cwd=ROOT, env={**engine_env(), "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    trainer_pid = None
    try:
        wait_for(lambda: runqueue.read(runs).running() is not None, 120, "the entry to start")
        run = RunPaths(Path(runqueue.read(runs).running().run))
        wait_for(lambda: (read_json(run.status) or {}).get("step", 0) >= 2, 300, "the trainer to take steps")
        trainer_pid = read_json(runqueue.folder(runs) / "trainer.json")["pid"]
        worker.send_signal(signal.SIGINT)
        output, _ = worker.communicate(timeout=300)
    finally:
        if worker.poll() is None:
            worker.kill()
        if trainer_pid and pid_alive(trainer_pid):
            os.kill(trainer_pid, signal.SIGKILL)
            pytest.fail("the trainer trains on after the worker was interrupted")
    assert worker.returncode == 130, output
    assert "asked #1 to stop" in output and "nothing was written" not in output, output
    wait_for(lambda: not pid_alive(trainer_pid), 30, "the trainer to end")
    status = read_json(run.status)
    assert status["state"] == "stopped", status
    assert list(run.checkpoints.glob("step_*/manifest.json")), "the stop saved no checkpoint"
    queue = runqueue.read(runs)
    assert [(e.name, e.state) for e in queue.entries] == [("long-1", "stopped"), ("next-2", "waiting")]
    assert queue.hold
    assert json.loads((runqueue.folder(runs) / "queue.json").read_text())["hold"] is True
