"""report_to=tensorboard: real event files under RUN/tensorboard, read back with TensorBoard's own reader."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import tensorboard  # noqa: E402,F401  (pinned in requirements.txt: never skipped)


def _events(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"images": 0, "scalars": 0})
    accumulator.Reload()
    return accumulator


def test_event_files_hold_the_run_metrics_and_samples(tiny_config, one_thread):
    from stabletune_core.train.loop import train

    config = tiny_config(report_to="tensorboard", max_train_steps=4, validation_loss_every=2,
                         validation_prompt="a red square", num_validation_images=1, validation_steps=4,
                         validation_inference_steps=2, diagnostics_every=0, activation_stats_every=0)
    train(config)
    root = Path(config.output_dir)
    metrics = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    events = _events(root / "tensorboard")
    tags = events.Tags()
    assert {"train/loss", "train/lr", "train/grad_norm", "memory/ram_mb", "validation/loss"} <= set(tags["scalars"])
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx([m["loss"] for m in metrics], rel=1e-6)
    assert [e.value for e in events.Scalars("train/lr")] == pytest.approx([m["lr"] for m in metrics])
    val = {e.step: e.value for e in events.Scalars("validation/loss")}
    assert val == pytest.approx({m["step"]: m["val_loss"] for m in metrics if "val_loss" in m}) and set(val) == {2, 4}
    # The validation images at step 0 (before training) and step 4, as PNGs of the training resolution.
    images = events.Images("samples/p00_s3")
    assert [i.step for i in images] == [0, 4]
    assert all((i.width, i.height) == (64, 64) and i.encoded_image_string[:4] == b"\x89PNG" for i in images)


def test_default_writes_no_event_files_and_missing_package_is_one_sentence(tiny_config, one_thread, monkeypatch,
                                                                           capsys):
    from stabletune_core.config import build_config
    from stabletune_core.train.observers import tensorboard
    from stabletune_core.train.loop import train

    assert build_config({}).report_to == "jsonl"
    assert build_config({"report_to": "none"}).report_to == "jsonl"  # accelerate's spelling
    assert build_config({"report_to": "all"}).report_to == "tensorboard"
    monkeypatch.setattr(tensorboard, "tensorboard_available", lambda: False)
    config = tiny_config(report_to="tensorboard", max_train_steps=1, diagnostics_every=0, activation_stats_every=0,
                         validation_loss_every=0)
    train(config)
    root = Path(config.output_dir)
    assert not (root / "tensorboard").exists()
    status = json.loads((root / "status.json").read_text())
    assert status["state"] == "finished"
    sentence = ("report_to=tensorboard needs the tensorboard package (pip install tensorboard==2.21.0); this run "
                "writes its metrics to metrics.jsonl only.")
    assert f"note: {sentence}" in capsys.readouterr().err
    events = [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines()]
    assert any(e["message"] == sentence for e in events)
