"""Issue 25: what the live tabs show of a real run (the engine trains in these tests; no browser): the
validation-loss curve, the run a page follows after Start or a delete, the Runs tab's list, a stop asked for
while the engine samples, the first chart points, and the learning summary after a resume."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from extension import plots
from stabletune_core.runs.layout import RunPaths
from stabletune_core.runs.writer import RunWriter


@pytest.fixture(scope="module")
def ui(tmp_path_factory: pytest.TempPathFactory):
    """The whole UI built in this process (no browser): its context, for calling the tabs' handlers."""
    from extension.settings import UISettings
    from extension.ui import build_ui

    return build_ui(UISettings(runs_dir=tmp_path_factory.mktemp("ui-runs"),
                               user_presets_dir=tmp_path_factory.mktemp("user-presets"))).stabletune_context


@pytest.fixture(scope="module")
def trained_run(tiny_model: Path, small_config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real engine run on the tiny model that measures the validation loss every 2 steps and logs every step:
    the engine writes `val_loss` into metrics.jsonl as well as into diagnostics/val_loss.jsonl."""
    import torch

    from stabletune_core.train.loop import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = tmp_path_factory.mktemp("engine") / "val-run"
        train(small_config(tiny_model, run, max_train_steps=6, validation_loss_every=2, logging_steps=1,
                           validation_count=2, validation_timesteps=2))
    finally:
        torch.set_num_threads(threads)
    return run


def test_monitor_draws_the_validation_loss_the_engine_logs_with_its_noise_bands(ui, trained_run: Path) -> None:
    """Issue 25.1: the engine logs `val_loss` in metrics.jsonl; merged with diagnostics/val_loss.jsonl it must
    stay one `val_loss` column (not val_loss_x / val_loss_y), so Monitor's loss chart has the validation curve.
    The noise bands the engine adds beside it are drawn too, when present."""
    from extension.tabs import monitor

    metrics = [json.loads(line) for line in RunPaths(trained_run).metrics.read_text().splitlines()]
    assert any("val_loss" in m for m in metrics), "the engine no longer logs val_loss in metrics.jsonl"
    summary, loss, *_ = monitor.refresh(ui, {"run": trained_run})
    validation = loss[loss["series"] == "validation loss"]
    assert sorted(validation["step"]) == [2, 4, 6], loss
    assert "best validation loss" in summary

    frame = plots.metrics_frame([{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.4, "val_loss": 0.45,
                                                            "val_loss_low_noise": 0.1, "val_loss_mid_noise": 0.4,
                                                            "val_loss_high_noise": 0.8}])
    merged = plots.with_val_loss(frame, [{"step": 2, "val_loss": 0.45}, {"step": 4, "val_loss": 0.43}])
    assert [c for c in merged.columns if c.startswith("val_loss")] == [
        "val_loss", "val_loss_low_noise", "val_loss_mid_noise", "val_loss_high_noise"]
    long = plots.plot_frame(merged, "loss")
    assert set(long["series"]) == {"loss", "loss (EMA)", "validation loss", "validation loss, low noise (t < 250)",
                                   "validation loss, mid noise (250-750)", "validation loss, high noise (t ≥ 750)"}
    assert sorted(long[long["series"] == "validation loss"]["step"]) == [2, 4]


def raw_form(ctx, **values) -> list:
    """What the browser sends for the whole form: the defaults as widgets show them, with `values`."""
    from extension.form import display_value

    shown = {n: display_value(f, f["default"]) for n, f in ctx.form.fields.items()}
    shown.update(values)
    return [shown[n] for n in ctx.form.names]


def stopped_run(ctx, name: str) -> Path:
    writer = RunWriter(ctx.settings.runs_dir / name)
    writer.status("stopped", step=3, max_steps=3)
    return writer.paths.root


def shown_after(value: str | None, *updates: dict) -> str | None:
    """The dropdown's value once the browser has applied `updates` in this order."""
    for change in updates:
        value = change.get("value", value)
    return value


def test_start_is_followed_even_when_a_refresh_tick_read_the_old_run(ui, tiny_model: Path, shapes_dataset: Path) -> None:
    """Issue 25.2: a refresh tick whose inputs were read before Start (the dropdown still showed the old run)
    and whose reply lands after Start's must not switch the page back to the old run: the run picker, status,
    and Stop/Pause follow the run that was started."""
    from extension.tabs import train as train_tab

    old = stopped_run(ui, "older-run")
    time.sleep(0.05)
    tick = {"label": "older-run", "run": ui.followed("older-run")}
    train_tab.refresh(ui, tick)  # the page has drawn the old run
    raw = raw_form(ui, pretrained_model_name_or_path=str(tiny_model), train_data_dir=str(shapes_dataset),
                   output_dir=str(ui.settings.runs_dir / "started-run"), resolution=64, bucket_step=8,
                   min_bucket_reso=32, max_bucket_reso=128, max_train_steps=500, validation_prompt="",
                   save_steps=1000)
    message, _, start_dropdown, *_ = train_tab._start(ui, *raw)
    try:
        assert message.startswith("Started **started-run**"), message
        assert start_dropdown["value"] == "started-run"
        late_tick = train_tab.refresh(ui, tick)  # inputs read before Start, answered after it
        assert shown_after("older-run", start_dropdown, late_tick[2]) == "started-run", late_tick[2]
        assert "started-run" in late_tick[2]["choices"]
        seen = {"label": "started-run", "run": ui.followed("started-run")}
        line, _, dropdown, _, *buttons = train_tab.refresh(ui, seen)
        enabled = dict(zip(train_tab.BUTTONS, (b.get("interactive") for b in buttons)))
        assert line.startswith("**started-run**") and "value" not in dropdown
        assert enabled["stop"] and enabled["pause"] and not enabled["start"]
    finally:
        process = ui.hub._procs[ui.settings.runs_dir / "started-run"]
        process.terminate()
        process.wait(120)
    assert old.is_dir()


def test_deleting_the_followed_run_leaves_no_failed_ghost_in_this_or_a_new_page(ui) -> None:
    """Issue 25.3: a run this UI started, that stopped cleanly (engine exit 0), is deleted while a page follows
    it: that page moves to another run, a new page does not pick it, and nothing calls it failed."""
    from extension.tabs import runs as runs_tab, train as train_tab

    stopped_run(ui, "kept-run")
    time.sleep(0.05)
    doomed = stopped_run(ui, "doomed-run")
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    ui.hub.started(doomed, finished)  # this UI started it; its engine exited 0 after writing `stopped`
    page = {"label": "doomed-run", "run": ui.followed("doomed-run")}
    assert train_tab.refresh(ui, page)[0].startswith("**doomed-run**: **stopped**")

    message, *_ = runs_tab._delete(ui, "doomed-run", True)
    assert message.startswith("Deleted **doomed-run**") and not doomed.exists()
    page = {"label": "doomed-run", "run": ui.followed("doomed-run")}  # the next tick of the same page
    line, _, dropdown, *_ = train_tab.refresh(ui, page)
    assert "failed" not in line and "doomed-run" not in line, line
    assert dropdown["value"] != "doomed-run" and "doomed-run" not in dropdown["choices"]
    fresh = {"label": None, "run": ui.followed(None)}  # a new browser
    line, _, dropdown, *_ = train_tab.refresh(ui, fresh)
    assert "failed" not in line and "doomed-run" not in line and "doomed-run" not in dropdown["choices"]
    assert ui.hub.status(doomed) == {"state": "none"}


def test_runs_tab_dropdown_lists_new_runs_with_the_table(ui) -> None:
    """Issue 25.7: the Runs tab's table refreshes itself; its run dropdown must change at the same tick (a run
    made after the page was built is in both), and a deleted choice is cleared."""
    from extension.tabs import runs as runs_tab

    assert ui.parts["runs.choice"] in runs_tab.live_outputs(ui)
    seen: dict = {}
    runs_tab.refresh(ui, seen, None)
    stopped_run(ui, "made-later")
    table, choice = runs_tab.refresh(ui, seen, None)
    assert "made-later" in list(table["run"]) and "made-later" in choice["choices"] and "value" not in choice
    assert runs_tab.refresh(ui, seen, "made-later") == [{"__type__": "update"}] * 2  # nothing new: nothing sent
    runs_tab._delete(ui, "made-later", True)
    table, choice = runs_tab.refresh(ui, seen, "made-later")
    assert "made-later" not in choice["choices"] and choice["value"] is None
