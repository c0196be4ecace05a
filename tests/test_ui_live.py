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
from ui_tools import raw_form


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
    assert set(long["series"]) == {"loss", "loss (EMA)", "validation loss"}
    bands = plots.plot_frame(merged, "val_noise")  # a chart of their own (issue 37.8: the legend ran off the edge)
    assert set(bands["series"]) == {"low noise (t < 250)", "mid noise (250-750)", "high noise (t ≥ 750)"}
    assert sorted(long[long["series"] == "validation loss"]["step"]) == [2, 4]


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


# ---- a stop asked for while the engine makes validation images (25.4), the first chart point (25.5) ------------
def slow_sampling_run(ctx, tiny_model: Path, shapes_dataset: Path, name: str, **overrides) -> Path:
    """A run on the tiny model whose step-0 validation images take a while (12 images, 20 denoising steps each),
    started as the Train tab starts one: config.toml written, the engine spawned in its own process."""
    from stabletune_core.launch import spawn, write_run_config

    values = dict(pretrained_model_name_or_path=str(tiny_model), train_data_dir=str(shapes_dataset),
                  output_dir=str(ctx.settings.runs_dir / name), resolution=64, bucket_step=8, min_bucket_reso=32,
                  max_bucket_reso=128, train_batch_size=4, max_train_steps=8, lora_rank=4, save_steps=1000, seed=3,
                  validation_prompt="a red circle | a blue square | a green triangle", num_validation_images=4,
                  validation_inference_steps=20, validation_steps=1000, validation_loss_every=0, logging_steps=1)
    values.update(overrides)
    run = write_run_config(values)
    ctx.hub.started(run, spawn(run))
    return run


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def step0_images(run: Path) -> int:
    folder = RunPaths(run).sample_dir(0)
    return len(list(folder.glob("*.png"))) if folder.is_dir() else 0


def state_of(run: Path) -> str:
    try:
        return json.loads(RunPaths(run).status.read_text()).get("state", "")
    except (OSError, ValueError):
        return ""


@pytest.fixture(scope="module")
def stopped_while_sampling(ui, tiny_model: Path, shapes_dataset: Path) -> dict:
    """Stop clicked (the Train tab's handler) while the engine makes its step-0 validation images."""
    from extension.tabs import train as train_tab

    run = slow_sampling_run(ui, tiny_model, shapes_dataset, "stop-while-sampling")
    process = ui.hub._procs[run]
    try:
        wait_for(lambda: state_of(run) == "sampling" and step0_images(run) >= 1, 240, "the step-0 images")
        clicked = {"images": step0_images(run), "at": time.time()}
        message = train_tab._control(ui, "stop", "stop-while-sampling")
        line = train_tab.status_now(ui, run)  # what the click puts on the page, not a later tick
        buttons = [b.get("interactive") for b in train_tab.refresh(ui, {"run": run})[4:]]  # the next tick's
        process.wait(300)
    finally:
        if process.poll() is None:
            process.kill()
    return {"run": run, "message": message, "line": line, "buttons": dict(zip(train_tab.BUTTONS, buttons)),
            "clicked": clicked, "ended": time.time(), "state": state_of(run), "made": step0_images(run), "due": 12}


def test_stop_while_sampling_shows_stop_requested_at_once(stopped_while_sampling: dict) -> None:
    """Issue 25.4 (UI half): the moment Stop is clicked during the validation images, the page says a stop is
    pending and why it waits, and offers nothing that would replace the stop (the engine reads one command)."""
    done = stopped_while_sampling
    assert done["message"].startswith("⏹ **Stop requested**"), done["message"]
    assert "**Stop requested**: waiting for the engine (it is making validation images now)" in done["line"]
    assert "validation images" in done["line"] and "/12" in done["line"], done["line"]
    assert done["buttons"] == {"start": False, "pause": False, "resume": False, "save": False, "sample": False,
                               "stop": True, "continue_run": False}
    assert done["state"] == "stopped"


def test_stop_while_sampling_is_honoured_between_images(stopped_while_sampling: dict) -> None:
    """Issue 25.4 (engine half): a stop asked for during the step-0 images ends the sampling at the next image:
    the run stops with the images made so far, not after all 12 (minutes on a loaded machine)."""
    done = stopped_while_sampling
    assert done["state"] == "stopped"
    assert done["made"] <= done["clicked"]["images"] + 1 < done["due"], done


@pytest.fixture(scope="module")
def first_points(ui, tiny_model: Path, shapes_dataset: Path) -> dict:
    """A run with slow step-0 images: what Monitor says while they are made, and when the first metric lands."""
    from extension.tabs import monitor

    run = slow_sampling_run(ui, tiny_model, shapes_dataset, "first-points", max_train_steps=4)
    process = ui.hub._procs[run]
    try:
        wait_for(lambda: state_of(run) == "sampling" and step0_images(run) >= 1, 240, "the step-0 images")
        summary = monitor.refresh(ui, {"run": run})[0]
        assert process.wait(300) == 0
    finally:
        if process.poll() is None:
            process.kill()
    events = [json.loads(line) for line in RunPaths(run).events.read_text().splitlines()]
    images_done = next(e["time"] for e in events if e["kind"] == "samples" and e.get("step") == 0)
    first_metric = json.loads(RunPaths(run).metrics.read_text().splitlines()[0])
    return {"summary": summary, "images_done": images_done, "first_metric": first_metric}


def test_monitor_says_what_the_engine_does_before_its_first_point(first_points: dict) -> None:
    """Issue 25.5 (UI half): while the step-0 images are made, Monitor says so, and how far. The engine makes
    them between its first training steps, so the charts already have points then (the engine half, below)."""
    summary = first_points["summary"]
    assert "making the step-0 validation images (" in summary and " of 12)" in summary, summary
    assert " of 12)." in summary or (summary.startswith("No metrics yet") and " of 12) before it trains." in summary)


def test_first_metric_is_logged_before_the_step0_images_are_done(first_points: dict) -> None:
    """Issue 25.5 (engine half): training metrics reach metrics.jsonl (and so the charts) while the step-0 images
    are still being made, not after them."""
    assert first_points["first_metric"]["time"] < first_points["images_done"], first_points


# ---- the learning summary after a resume (25.9) --------------------------------------------------------------------
def test_train_tab_shows_the_summary_the_engine_recorded(ui) -> None:
    """Issue 25.9 (UI half): the Train tab shows the learning summary the engine wrote, from status.json or, when a
    later process rewrote status.json without it, from its newest `learning` event (never reworded here)."""
    from extension.tabs import train as train_tab

    writer = RunWriter(ui.settings.runs_dir / "summarised")
    writer.event("learning", "Learning summary (as the engine words it): purple: 61 deg off -> 4 deg off.", step=20)
    writer.event("checkpoint", "Saved checkpoint at step 20 (asked from the UI).", step=20)  # a later event
    writer.status("finished", step=20, max_steps=20)  # no `summary` field in this status.json
    line = train_tab.refresh(ui, {"run": writer.paths.root})[0]
    assert "Learning summary (as the engine words it): purple: 61 deg off -> 4 deg off." in line
    writer.status("finished", step=20, max_steps=20, summary="Written in status.json.")
    assert "Written in status.json." in train_tab.refresh(ui, {"run": writer.paths.root})[0]


def test_summary_after_resume_counts_from_the_runs_step0_sampling(ui, toy_cache: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 25.9 (engine half): a toy run stopped after its step-8 sampling and continued with the Train tab's
    "Resume run from checkpoint" ends with a summary that counts from step 0 (purple far off -> ...), not from
    the first sampling after the resume (purple already learnt there): the judge reads RUN/samples/ (issue 21.1)."""
    from extension.tabs import train as train_tab
    from stabletune_core.demo import demo_config
    from stabletune_core.launch import spawn
    from stabletune_core.toy.judge import judge_samples, learning_summary

    monkeypatch.setenv("STABLETUNE_CACHE", str(toy_cache))  # the toy model and its dataset, for this process and
    run = ui.settings.runs_dir / "resumed-toy"  # the engines it spawns
    config = demo_config(run, max_train_steps=24).model_copy(update=dict(
        output_dir=str(run), learning_rate=1e-2, text_encoder_lr=5e-3, lr_warmup_steps=0, validation_steps=8,
        save_steps=8, num_validation_images=1, validation_inference_steps=10, validation_loss_every=0,
        validation_prompt="a purple circle | a purple square | a purple triangle | a red circle"))
    config.save_toml(RunPaths(run).config)
    first = spawn(run)
    try:
        wait_for(lambda: any('"sample_score"' in line and '"step":8' in line
                             for line in (RunPaths(run).events.read_text().splitlines()
                                          if RunPaths(run).events.exists() else [])), 300, "the step-8 sampling")
        RunPaths(run).control.write_text('{"command": "stop"}')
        assert first.wait(300) == 130 or state_of(run) == "stopped"
    finally:
        if first.poll() is None:
            first.kill()
    message, *_ = train_tab._continue_run(ui, "resumed-toy")
    assert message.startswith("Started **resumed-toy**"), message
    second = ui.hub._procs[run]
    try:
        assert second.wait(300) == 0, RunPaths(run).log.read_text()[-2000:]
    finally:
        if second.poll() is None:
            second.kill()
    folders = sorted(p for p in RunPaths(run).samples.glob("step_*") if list(p.glob("*.png")))
    step0, after_resume, last = folders[0], folders[2], folders[-1]
    assert (step0.name, after_resume.name, last.name) == ("step_000000", "step_000016", "step_000024")
    assert judge_samples(after_resume) != judge_samples(step0)  # else this test could not tell the two apart
    summary = json.loads(RunPaths(run).status.read_text())["summary"]
    assert learning_summary(run) in summary, summary
    assert summary.split(": ", 1)[1].startswith(f"purple: {judge_samples(step0)['concept']['purple']:.0f} deg off -> "
                                                f"{judge_samples(last)['concept']['purple']:.0f} deg off"), summary
