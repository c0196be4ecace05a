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
from extension.form import Form
from extension.schema import load_schema
from extension.session import RunHub
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
