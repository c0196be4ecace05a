"""Issue 37.5 and 37.14: the checkpoint grid is cancellable (the UI's Cancel, Ctrl-C) and leaves a clean state, says
what it is doing, computes on the threads a training of the model would (its speed against the run's own sampling
is bench/grid_speed.py's claim, not a timed test), and refuses a NaN or infinite strength in one sentence."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stabletune_core.launch import engine_env, write_run_config
from test_grid import ROOT, grid, train, values

MANY_STRENGTHS = ",".join(f"{i / 10:g}" for i in range(40))  # long enough to be caught while it renders


@pytest.fixture(scope="module")
def run(tiny_model: Path, shapes_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_run_config(values(tiny_model, shapes_dataset, tmp_path_factory.mktemp("grid37") / "run"))
    done = train(folder)
    _, err = done.communicate(timeout=300)
    assert done.returncode == 0, err[-2000:]
    return folder


def progress(run: Path, name: str) -> dict:
    try:
        return json.loads((run / "grids" / f"{name}.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_rendering(run: Path, name: str, process: subprocess.Popen | None = None, *, doing: str = "") -> dict:
    """The grid's progress once it has rendered an image and says it is `doing` (a prefix): the base model's column
    comes first, so a test of the checkpoints' progress waits for them instead of reading whatever comes first."""
    deadline = time.time() + 240
    while True:
        meta = progress(run, name)
        if meta.get("state") == "rendering" and meta.get("done", 0) >= 1 and meta.get("doing", "").startswith(doing):
            return meta
        assert time.time() < deadline and (process is None or process.poll() is None), meta
        time.sleep(0.2)


@pytest.mark.parametrize("strengths", ["nan", "0,inf", "-inf"])
def test_a_strength_that_is_not_finite_is_one_sentence(run: Path, strengths: str) -> None:
    done = grid(str(run), f"--strengths={strengths}", timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: --strengths holds "), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "finite numbers" in done.stderr
    assert not (run / "grids").exists() or not list((run / "grids").glob("*.png"))


def test_the_ui_cancels_a_grid_and_nothing_is_left_half_made(run: Path) -> None:
    """Render grid, then Cancel grid (the UI's own functions, a real grid process): it stops at its next image,
    writes no PNG, says `cancelled`; meanwhile its progress line says what it does and how long is left; it chose
    its CPU threads as a training of this model does (torch's one per core made it 10-30x slower per image)."""
    from extension import grids

    said = grids.start(sys.executable, run, ["step 6"], MANY_STRENGTHS, "")
    name = said.split("**")[1]
    meta = wait_rendering(run, name, doing="rendering step_000006 at strength")
    assert meta["seconds_left"] > 0, meta
    line = grids.progress_text(run)
    assert line.startswith(f"⏳ **{name}**: rendering step_000006 at strength") and "left" in line, line
    assert grids.cancel(run).startswith(f"Cancelling **{name}**")
    deadline = time.time() + 120
    while progress(run, name).get("state") == "rendering":
        assert time.time() < deadline, "the grid did not stop"
        time.sleep(0.2)
    meta = progress(run, name)
    assert meta["state"] == "cancelled" and meta["done"] < meta["total"], meta
    assert sorted(p.name for p in (run / "grids").iterdir() if p.stem == name) == [f"{name}.json", f"{name}.log"]
    assert grids.progress_text(run) == f"✖ **{name}** was cancelled; no grid was written."
    log = (run / "grids" / f"{name}.log").read_text()
    assert "grid: Rendering with 1 CPU thread" in log, log[-1500:]
    assert grids.cancel(run) == "No grid of this run is rendering."


def test_ctrl_c_cancels_the_grid_command_cleanly(run: Path) -> None:
    process = subprocess.Popen([sys.executable, "-m", "stabletune_core", "grid", str(run), "--checkpoints", "3",
                                "--strengths", MANY_STRENGTHS, "--name", "interrupted"], cwd=ROOT,
                               env={**engine_env(), "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        wait_rendering(run, "interrupted", process)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
    assert process.returncode == 130, err
    assert err.strip().splitlines()[-1] == "error: grid cancelled; no grid was written (the run is untouched).", err
    assert progress(run, "interrupted")["state"] == "cancelled"
    assert not (run / "grids" / "interrupted.png").exists() and not (run / "grids" / "interrupted.cancel").exists()
    assert not [p for p in (run / "grids").iterdir() if p.name.startswith(".")]  # no temporary left
