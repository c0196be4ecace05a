"""Deterministic validation loss, the held-out split, and early stopping that keeps and exports the best LoRA."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stabletune_core.train.guards.early_stopping import judge


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]



pytestmark = pytest.mark.usefixtures("one_thread")

# ---- the rule -------------------------------------------------------------------------------------------
def _history(values):
    return [(10 * (i + 1), v) for i, v in enumerate(values)]


def test_rule_stops_after_patience_triggers_above_the_best_window():
    falling = [1.0, 0.8, 0.6, 0.5, 0.48, 0.47, 0.46, 0.47]
    rule = dict(window=4, factor=1.3, patience=3, min_steps=0)
    assert not judge(_history(falling), **rule).stop
    # Best window {0.46, 0.47, 0.47, 0.48}: upper quartile ~0.4725, threshold ~0.614.
    rising = falling + [0.62, 0.55, 0.70, 0.80]
    verdicts = [judge(_history(rising[:n]), **rule) for n in range(len(falling) + 1, len(rising) + 1)]
    assert [v.triggered for v in verdicts] == [True, False, True, True]
    assert [v.stop for v in verdicts] == [False, False, False, True]
    assert verdicts[-1].best_step == 70 and verdicts[-1].threshold == pytest.approx(1.3 * 0.4725, rel=1e-3)
    assert not judge(_history(rising), **{**rule, "min_steps": 1000}).stop  # never before min_steps
    # A new best resets the count.
    assert not judge(_history(rising[:-1] + [0.40, 0.70, 0.80]), **rule).stop


# ---- deterministic validation loss ----------------------------------------------------------------------
def test_held_out_images_never_train(tiny_config):
    from stabletune_core.train.loop import setup

    s = setup(tiny_config(validation_split=0.25, validation_loss_every=5))
    held = {str(item.path) for item in s.validation_items}
    trained = {str(s.data.items[i].path) for i, _ in s.data.entries()}
    assert len(held) == 2 and not held & trained and len(trained) == 6


def test_validation_loss_is_identical_twice_and_after_a_resume(tiny_config):
    from stabletune_core.train.loop import setup, train

    config = tiny_config(max_train_steps=4, save_steps=4, validation_split=0.25, validation_loss_every=2,
                         diagnostics_every=0, activation_stats_every=0, lora_dropout=0.3)
    s = setup(config)
    train(config, session=s)
    from stabletune_core.train.session import SessionView

    guard = next(o for o in s.observers if o.name == "validation_loss")
    first, second = guard.measure(SessionView(s)).loss, guard.measure(SessionView(s)).loss
    assert first == second
    logged = _lines(Path(config.output_dir) / "diagnostics" / "val_loss.jsonl")
    assert [r["step"] for r in logged] == [2, 4] and logged[-1]["val_loss"] == first and logged[0]["held_out"]
    assert logged[0]["val_loss"] != logged[1]["val_loss"]

    resumed = config.model_copy(update={"resume_from_checkpoint": "auto"})
    s2 = setup(resumed)
    from stabletune_core.train.loop import resume

    resume(s2)
    assert s2.state.step == 4
    guard2 = next(o for o in s2.observers if o.name == "validation_loss")
    assert guard2.measure(SessionView(s2)).loss == first
    assert guard2.history == guard.history  # the curve travels in the checkpoint


def test_validation_loss_by_noise_band_is_fixed_and_survives_a_resume(tiny_config):
    """Issue 21.7: beside val_loss, metrics.jsonl has the loss at low (t < 250), mid (250 <= t < 750) and high
    (t >= 750) noise, from the same fixed noise and timesteps; an interrupted run resumed from its checkpoint
    logs exactly the numbers the uninterrupted run logged."""
    from stabletune_core.train.loop import train

    common = dict(max_train_steps=4, save_steps=2, validation_split=0.25, validation_loss_every=2,
                  validation_timesteps=4, diagnostics_every=0, activation_stats_every=0, lora_dropout=0.3)
    straight = tiny_config(output_dir=str(Path(tiny_config().output_dir).parent / "straight"), **common)
    train(straight)
    lines = [m for m in _lines(Path(straight.output_dir) / "metrics.jsonl") if "val_loss" in m]
    bands = ("val_loss_low_noise", "val_loss_mid_noise", "val_loss_high_noise")
    assert [m["step"] for m in lines] == [2, 4] and all(set(bands) <= set(m) for m in lines)
    for m in lines:  # timesteps 125 | 375, 625 | 875: one, two and one row per image
        low, mid, high = (m[k] for k in bands)
        assert m["val_loss"] == pytest.approx((low + 2 * mid + high) / 4, rel=1e-6)
        assert high != low
    logged = _lines(Path(straight.output_dir) / "diagnostics" / "val_loss.jsonl")
    assert [r["timesteps"] for r in logged] == [[125, 375, 625, 875]] * 2
    assert [[r[k] for k in bands] for r in logged] == [[m[k] for k in bands] for m in lines]

    resumed = tiny_config(output_dir=str(Path(straight.output_dir).parent / "resumed"), **common,
                          resume_from_checkpoint=str(Path(straight.output_dir) / "checkpoints" / "step_000002"))
    train(resumed)
    again = [m for m in _lines(Path(resumed.output_dir) / "metrics.jsonl") if "val_loss" in m]
    assert [m["step"] for m in again] == [4]
    assert [again[0][k] for k in ("val_loss", *bands)] == [lines[1][k] for k in ("val_loss", *bands)]


# ---- early stopping on an overfitting run ---------------------------------------------------------------
@pytest.fixture(scope="module")
def textures(tmp_path_factory) -> Path:
    """Three random 16x16-pixel textures (upscaled to 64): two train, one is held out."""
    import numpy as np
    from PIL import Image

    folder = tmp_path_factory.mktemp("textures")
    rng = np.random.default_rng(0)
    for i in range(3):
        pixels = (rng.random((16, 16, 3)) * 255).astype(np.uint8)
        Image.fromarray(pixels).resize((64, 64), Image.NEAREST).save(folder / f"t{i}.png")
        (folder / f"t{i}.txt").write_text("a texture")
    return folder


def test_overfitting_run_stops_early_and_exports_the_best(tiny_config, textures):
    """Two training images, a learning rate ramped far too high: held-out loss falls, then climbs.

    The tiny model's loss lives in a narrow band (a random model scores ~1.0), so the factor is 1.15 here
    instead of the default 1.3; the rule and the code path are the same.
    """
    from safetensors.torch import load_file

    from stabletune_core.train.checkpoint import load_checkpoint
    from stabletune_core.train.loop import setup, train

    window = 4
    config = tiny_config(train_data_dir=str(textures), train_batch_size=2, max_train_steps=72, lora_rank=8,
                         lora_alpha=16, learning_rate=6e-2, lr_scheduler="constant_with_warmup",
                         lr_warmup_steps=60, validation_split=0.34, validation_loss_every=4, validation_timesteps=4,
                         unet_lora_targets=["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out",
                                            "ff.net.0.proj", "ff.net.2"],
                         early_stopping=True, early_stopping_window=window, early_stopping_factor=1.15,
                         early_stopping_patience=3, early_stopping_min_steps=0, diagnostics_every=0,
                         activation_stats_every=0, checkpoints_total_limit=1)
    s = setup(config)
    last = train(config, session=s)
    run = Path(config.output_dir)
    curve = _lines(run / "diagnostics" / "val_loss.jsonl")
    values = [r["val_loss"] for r in curve]
    best = min(range(len(values)), key=values.__getitem__)
    assert values[-1] > 1.15 * values[best] and best < len(values) - 1, values  # it rose after its minimum
    assert s.state.step < config.max_train_steps, "early stopping never fired"
    assert len(values) - 1 - best <= 2 * window, (values, best)  # within 2 evaluation windows of the minimum

    events = _lines(run / "events.jsonl")
    stop = [e for e in events if e["kind"] == "early_stop"]
    assert len(stop) == 1 and stop[0]["best_step"] == curve[best]["step"] and "above 1.15" in stop[0]["message"]
    assert events[-1]["kind"] == "stopped"

    best_file = run / "output" / "lora_best.safetensors"
    assert last == run / "output" / "lora.safetensors" and last.exists() and best_file.exists()
    best_checkpoint = run / "checkpoints" / f"step_{curve[best]['step']:06d}"
    assert best_checkpoint.exists(), "pruning removed the best checkpoint"
    # The exported best LoRA holds the best checkpoint's weights, not the last ones.
    adapter = load_checkpoint(best_checkpoint).adapter
    exported, final = load_file(best_file), load_file(last)
    down = next(k for k in exported if k.endswith("lora_down.weight"))
    assert not torch.equal(exported[down], final[down])
    assert any(torch.equal(exported[down], v) for v in adapter.values() if v.shape == exported[down].shape)


def test_a_big_enough_dataset_holds_images_out_by_default_and_says_so(tiny_config, tmp_path):
    """validation_split left empty: 10 % (at least one image) of a dataset of 8 or more is held out."""
    import shutil

    from stabletune_core.train.loop import setup

    s = setup(tiny_config(validation_split=None, validation_loss_every=5))
    events = [json.loads(line) for line in s.run.paths.events.read_text().splitlines()]
    held = next(e for e in events if e["kind"] == "validation_split")
    assert len(s.validation_items) == 1 and len(held["held_out"]) == 1 and "automatic" in held["message"]
    assert str(s.validation_items[0].path) not in {str(s.data.items[i].path) for i, _ in s.data.entries()}

    small = tmp_path / "seven"
    shutil.copytree(s.config.train_data_dir, small)
    for leftover in sorted(small.glob("*.png"))[7:]:
        leftover.unlink()
        leftover.with_suffix(".txt").unlink(missing_ok=True)
    s = setup(tiny_config(validation_split=None, train_data_dir=str(small), output_dir=str(tmp_path / "run7")))
    assert s.validation_items == []  # too few images to spare one


def test_the_best_lora_and_its_ema_are_those_of_the_best_step(tiny_config):
    """`lora_best-ema` is the moving average at the best step, not the last step's average beside the best
    weights; and exporting the best puts the run's current weights, EMA and optimizer back bit for bit."""
    from safetensors.torch import load_file

    from stabletune_core.train.loop import export_best
    from stabletune_core.train.loop import setup, train

    config = tiny_config(max_train_steps=3, save_steps=3, ema_decay=0.9, learning_rate=1e-2)
    train(config)
    output = Path(config.output_dir) / "output"
    at_step_3 = {name: load_file(output / f"{name}.safetensors") for name in ("lora", "lora-ema")}
    longer = config.model_copy(update={"max_train_steps": 6, "resume_from_checkpoint": "auto"})
    s = setup(longer)
    train(longer, session=s)
    at_step_6 = load_file(output / "lora-ema.safetensors")
    weights = [p.detach().clone() for p in s.params]
    ema = [t.clone() for t in s.ema.shadow]
    moments = [v.clone() for state in s.optimizer.state_dict()["state"].values() for v in state.values()]

    s.state.best_checkpoint = Path(config.output_dir) / "checkpoints" / "step_000003"
    export_best(s)
    for name, expected in (("lora_best", at_step_3["lora"]), ("lora_best-ema", at_step_3["lora-ema"])):
        exported = load_file(output / f"{name}.safetensors")
        assert exported.keys() == expected.keys()
        assert all(torch.equal(exported[k], expected[k]) for k in expected), name
    assert any(not torch.equal(at_step_6[k], at_step_3["lora-ema"][k]) for k in at_step_6)  # it did move on
    assert all(torch.equal(p, w) for p, w in zip(s.params, weights))
    assert all(torch.equal(a, b) for a, b in zip(s.ema.shadow, ema))
    after = [v for state in s.optimizer.state_dict()["state"].values() for v in state.values()]
    assert all(torch.equal(a, b) for a, b in zip(after, moments))


def test_holding_images_out_keeps_what_the_scan_said_about_the_folders(tiny_config, tmp_path):
    """A `0_` folder is left out with a note; holding validation images out must not lose that note."""
    import shutil

    from stabletune_core.train.loop import setup

    data = tmp_path / "data"
    shutil.copytree(tiny_config().train_data_dir, data / "1_kept")
    (data / "0_left_out").mkdir()
    shutil.copy(next((data / "1_kept").glob("*.png")), data / "0_left_out" / "x.png")
    s = setup(tiny_config(train_data_dir=str(data), validation_split=0.25, output_dir=str(tmp_path / "run")))
    assert s.validation_items
    notes = [json.loads(line)["message"] for line in s.run.paths.events.read_text().splitlines()
             if json.loads(line)["kind"] == "data"]
    assert any("0_left_out" in note for note in notes), notes
