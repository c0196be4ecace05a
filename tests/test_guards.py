"""The guards, one job each: units on real tensors and optimizers, then short real runs on the tiny model.

GPU-only behaviour (fp16 divergence on a GPU, VRAM after sampling, the preflight's micro-batch search) is tested
at the bottom and skipped without CUDA; the fp16 fallback itself also runs on the CPU (test_amp.py).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers.optimization import get_scheduler

from stabletune_core.runs.reader import RunReader, latest_timeline
from stabletune_core.runs.writer import RunWriter
from stabletune_core.train import faults
from stabletune_core.train.amp import MixedPrecision
from stabletune_core.train.checkpoint import (CheckpointError, latest_good_checkpoint, list_checkpoints,
                                              load_checkpoint, prune_checkpoints, remove_stale_temporaries,
                                              save_checkpoint)
from stabletune_core.train.guards.clipping import ClipGuard
from stabletune_core.train.guards.plateau import PlateauGuard
from stabletune_core.train.guards.nonfinite import NonFiniteGuard
from stabletune_core.train.guards.precision import fallback_precision, should_fall_back
from stabletune_core.train.lr_schedule import LearningRateSchedule

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def injected():
    """Install faults for an in-process run; always uninstalled afterwards."""
    yield faults.install
    faults.install(None)


def metrics_of(run_dir: Path) -> list[dict]:
    return RunReader(run_dir).metrics()


def events_of(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in RunReader(run_dir).events() if e["kind"] == kind]


# ---- faults module -------------------------------------------------------------------------------------
def test_faults_are_inert_without_the_variable_and_typos_are_errors():
    assert "STABLETUNE_FAULTS" not in os.environ and not faults.ACTIVE
    assert faults.parse(None) == {} and faults.parse("") == {}
    parsed = faults.parse("nan_loss@5, oom@3,oom@3,disk_full@save:4,kill@step:6,kill@checkpoint:4")
    assert parsed[("oom", 3)] == 2 and parsed[("disk_full@save", 4)] == 1 and parsed[("kill@step", 6)] == 1
    with pytest.raises(ValueError, match="nan@3"):
        faults.parse("nan@3")


# ---- clipping ------------------------------------------------------------------------------------------
def test_adaptive_clipping_follows_a_percentile_of_recent_norms():
    guard = ClipGuard("adaptive", max_norm=0, percentile=90, window=20)
    assert guard.threshold() == math.inf  # too little history: no clipping yet
    for norm in range(1, 31):
        guard.threshold()
        guard.before_optimizer_step(None, 1.0, float(norm))
    guard.before_optimizer_step(None, float("nan"), float("nan"))  # non-finite norms never enter the history
    assert guard.threshold() == pytest.approx(np.percentile(np.arange(11, 31), 90))
    again = ClipGuard("adaptive", max_norm=0, percentile=90, window=20)
    again.load_state_dict(guard.state_dict())
    assert again.threshold() == guard.threshold()  # a resumed run clips exactly the same
    assert ClipGuard("adaptive", max_norm=5.0, percentile=90, window=20).threshold() == 5.0  # ceiling
    ceiling = ClipGuard("adaptive", max_norm=5.0, percentile=90, window=20)
    ceiling.load_state_dict(guard.state_dict())
    assert ceiling.threshold() == 5.0
    assert ClipGuard("fixed", max_norm=1.0).threshold() == 1.0
    assert ClipGuard("off", max_norm=1.0).threshold() == math.inf


# ---- learning rate: plateau and rollback ---------------------------------------------------------------
def small_session(tmp_path: Path, lr: float = 1e-2) -> SimpleNamespace:
    """A real parameter, AdamW, a diffusers schedule and a run directory: what the LR-touching guards use."""
    param = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([param], lr=lr)
    scheduler = LearningRateSchedule(optimizer, lambda o: get_scheduler("constant", optimizer=o))
    module = torch.nn.Module()
    module.lora_A = param
    from stabletune_core.train.session import TrainState

    return SimpleNamespace(params=[param], optimizer=optimizer, lr_scheduler=scheduler, run=RunWriter(tmp_path),
                           state=TrainState(micro_batch_size=4, batch_paths=["a.png"]), max_steps=100,
                           amp=MixedPrecision("no", "cpu"), ranks=SimpleNamespace(unwrap=lambda m: m),
                           trained={"unet": module})


def decide(s, guard, verdicts) -> list:
    """Carry `guard`'s verdicts out as the loop does; returns them."""
    from stabletune_core.train.loop import carry_out

    carry_out(s, guard, verdicts)
    return list(verdicts)


def view_of(s):
    from stabletune_core.train.session import SessionView

    return SessionView(s)


def test_plateau_lowers_the_rate_after_patience_and_never_below_min_lr(tmp_path):
    s = small_session(tmp_path, lr=1e-2)
    guard = PlateauGuard(patience=2, factor=0.5, min_lr=3e-3)
    for val in (1.0, 0.9, 0.95, 0.91):  # two evaluations without a new best
        decide(s, guard, guard.after_measuring(view_of(s), {"val_loss": val}))
    assert s.optimizer.param_groups[0]["lr"] == pytest.approx(5e-3)
    s.optimizer.step()  # no gradients: changes nothing, but keeps the scheduler's order check quiet
    s.lr_scheduler.step()
    assert s.lr_scheduler.get_last_lr()[0] == pytest.approx(5e-3)  # the schedule keeps the lower rate
    for val in (0.95, 0.95, 0.95, 0.95):
        decide(s, guard, guard.after_measuring(view_of(s), {"val_loss": val}))
    assert s.optimizer.param_groups[0]["lr"] == pytest.approx(3e-3)  # floored at min_lr
    assert not guard.after_measuring(view_of(s), {"loss": 1.0})  # steps without validation loss change nothing
    assert [e["new_lr"] for e in events_of(tmp_path, "lr_plateau")] == pytest.approx([5e-3, 3e-3])


def test_repeated_nonfinite_steps_roll_back_weights_and_optimizer_and_lower_the_rate(tmp_path):
    from stabletune_core.train.guards.verdicts import RollBack, SkipStep, TakeSnapshot

    s = small_session(tmp_path, lr=1e-2)
    guard = NonFiniteGuard(window=10, max_bad=2, lr_factor=0.1)
    assert decide(s, guard, guard.on_start(view_of(s))) == [TakeSnapshot()]  # snapshot of the good state
    for _ in range(3):  # good steps move the weights
        s.params[0].grad = torch.ones(4)
        s.optimizer.step()
        s.state.step += 1
    moved = s.params[0].detach().clone()
    assert decide(s, guard, guard.before_optimizer_step(view_of(s), 1.0, 0.5)) == []
    s.params[0].grad = torch.full((4,), float("nan"))
    skipped = decide(s, guard, guard.before_optimizer_step(view_of(s), float("nan"), float("nan")))
    assert [type(v) for v in skipped] == [SkipStep] and skipped[0].what == "loss"
    assert torch.equal(s.params[0].detach(), moved)  # one bad step: skipped, nothing rolled back
    rolled = decide(s, guard, guard.before_optimizer_step(view_of(s), 1.0, float("inf")))
    assert [type(v) for v in rolled] == [SkipStep, RollBack] and rolled[1].bad_steps == (4, 4)
    assert torch.equal(s.params[0].detach(), torch.ones(4))  # rolled back to the snapshot
    assert s.optimizer.state_dict()["state"] == {}  # the snapshot had no Adam moments yet
    assert s.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    rollback = events_of(tmp_path, "rollback")
    assert len(rollback) == 1 and "back to step 0" in rollback[0]["message"]
    assert [e["what"] for e in events_of(tmp_path, "nonfinite")] == ["loss", "gradients"]


# ---- precision fallback (decision logic; the switch itself: test_amp.py, and on a GPU the end of this file) -
def test_fp16_fallback_decision():
    assert not should_fall_back(overflow_streak=3, scale=1024.0, max_skips=8)
    assert should_fall_back(overflow_streak=8, scale=1024.0, max_skips=8)
    assert should_fall_back(overflow_streak=0, scale=2.0**-5, max_skips=8)  # the scale collapsed
    if not torch.cuda.is_available():
        assert fallback_precision() == "no"


# ---- weight norms --------------------------------------------------------------------------------------
def update_norm(down: torch.Tensor, up: torch.Tensor, scaling: float) -> torch.Tensor:
    """||scaling x up @ down||_F without forming the (out x in) product: tr((up^T up)(down down^T)), the
    per-layer form of what the weight-norm guard computes batched."""
    d = down.reshape(down.shape[0], -1).float()
    u = up.reshape(up.shape[0], -1).float()
    return ((u.T @ u) * (d @ d.T)).sum().clamp(min=0).sqrt() * abs(scaling)


def test_update_norm_matches_the_explicit_product():
    g = torch.Generator().manual_seed(0)
    down, up = torch.randn(4, 32, generator=g), torch.randn(48, 4, generator=g)
    assert float(update_norm(down, up, 2.0)) == pytest.approx(float(torch.linalg.norm(2.0 * up @ down)), rel=1e-5)
    conv_down, conv_up = torch.randn(4, 8, 3, 3, generator=g), torch.randn(16, 4, 1, 1, generator=g)
    explicit = conv_up.flatten(1) @ conv_down.flatten(1)
    assert float(update_norm(conv_down, conv_up, 1.0)) == pytest.approx(float(torch.linalg.norm(explicit)), rel=1e-5)


def test_weight_norm_scaling_and_block_wise_rates_on_a_real_run(tiny_config):
    from stabletune_core.lora.layers import iter_lora_layers
    from stabletune_core.train.loop import setup, train

    config = tiny_config(max_train_steps=3, learning_rate=1e-2, scale_weight_norms=0.05, down_lr_scale=0.0,
                         up_lr_scale=0.5)
    s = setup(config)
    groups = s.optimizer.param_groups
    assert [g["lr"] for g in groups] == pytest.approx([1e-2, 5e-3])  # full-rate group first
    unet = s.ranks.unwrap(s.trained["unet"])
    frozen = {n: p.detach().clone() for n, p in unet.named_parameters() if "lora_" in n and n.startswith("down_")}
    assert frozen and not any(p.requires_grad for n, p in unet.named_parameters() if n in frozen)
    train(config, session=s)
    assert all(torch.equal(p, frozen[n]) for n, p in unet.named_parameters() if n in frozen)
    norms = [float(update_norm(d.detach(), u.detach(), c)) for d, u, c in
             ((layer.down, layer.up, layer.scaling) for layer in iter_lora_layers(unet))]
    assert max(norms) <= 0.05 * (1 + 1e-4) and max(norms) > 0.04  # capped, and something hit the cap
    metrics = metrics_of(Path(config.output_dir))
    assert all(m["keys_scaled"] > 0 for m in metrics) and all(m["max_weight_norm"] > 0.05 for m in metrics)


# ---- non-finite: a plain loop dies, the guarded one does not -------------------------------------------
def test_plain_loop_is_poisoned_by_a_nan_gradient_while_the_guarded_run_finishes_finite(tiny_config, tmp_path,
                                                                                        injected):
    from stabletune_core.train.loop import setup, train

    def run(name: str, guard: bool) -> tuple[list[torch.Tensor], Path]:
        injected("nan_grad@2")
        config = tiny_config(max_train_steps=2, nan_guard=guard, output_dir=str(tmp_path / name))
        s = setup(config)
        train(config, session=s)
        return [p.detach() for p in s.params], Path(config.output_dir)

    plain, _ = run("plain", False)
    assert any(not torch.isfinite(p).all() for p in plain)  # AdamW spread one NaN gradient into the weights
    guarded, run_dir = run("guarded", True)
    assert all(torch.isfinite(p).all() for p in guarded)
    assert [e["step"] for e in events_of(run_dir, "nonfinite")] == [2]


# ---- out of memory -------------------------------------------------------------------------------------
def test_oom_halves_the_micro_batch_and_keeps_the_trajectory(tiny_config, tmp_path, injected):
    from stabletune_core.train.loop import train

    clean = tiny_config(max_train_steps=2, output_dir=str(tmp_path / "clean"))
    train(clean)
    injected("oom@2,oom@2")  # step 2 fails twice: micro-batch 4 -> 2 -> 1
    shrunk = tiny_config(max_train_steps=2, output_dir=str(tmp_path / "oom"))
    train(shrunk)
    a, b = metrics_of(tmp_path / "clean"), metrics_of(tmp_path / "oom")
    assert [m["micro_batch_size"] for m in b] == [4, 1]
    assert [m["images_seen"] for m in b] == [m["images_seen"] for m in a] == [4, 8]
    assert b[0]["loss"] == a[0]["loss"]
    for x, y in zip(a[1:], b[1:]):  # same noise and images; only the summation order differs
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
    assert [(e["old_micro_batch"], e["new_micro_batch"]) for e in events_of(tmp_path / "oom", "oom")] == [(4, 2),
                                                                                                         (2, 1)]
    assert load_checkpoint(tmp_path / "oom" / "checkpoints" / "step_000002").state["train"]["micro_batch_size"] == 1


def test_oom_at_micro_batch_one_stops_with_advice_and_a_checkpoint(tiny_config, tmp_path, injected):
    from stabletune_core.train.guards import OutOfMemoryStop
    from stabletune_core.train.loop import train

    injected("oom@1,oom@1")
    config = tiny_config(max_train_steps=3, train_batch_size=2, output_dir=str(tmp_path / "run"))
    with pytest.raises(OutOfMemoryStop, match="even with micro-batch 1.*gradient_checkpointing"):
        train(config)
    status = RunReader(tmp_path / "run").status()
    assert status["state"] == "failed" and "resume with --resume auto" in status["error"]
    assert latest_good_checkpoint(tmp_path / "run" / "checkpoints").step == 0


def test_preflight_command_reports_memory_and_leaves_the_run_dir_alone(tiny_config, tmp_path, capsys):
    from stabletune_core.cli import main

    config = tiny_config(output_dir=str(tmp_path / "run"))
    config.save_toml(tmp_path / "c.toml")
    assert main(["preflight", "--config", str(tmp_path / "c.toml")]) == 0
    out = capsys.readouterr().out
    assert "largest_bucket=" in out and "peak_rss_mb=" in out and "step_seconds=" in out
    assert not (tmp_path / "run").exists()


def test_preflight_in_a_run_changes_nothing_in_the_trajectory(tiny_config, tmp_path):
    from stabletune_core.train.loop import run_preflight, setup

    s = setup(tiny_config())
    before = (torch.get_rng_state(), s.state.micro_batch_size)
    report = run_preflight(s)
    assert report["peak_rss_mb"] > 0 and report["largest_bucket"]
    assert torch.equal(torch.get_rng_state(), before[0])
    assert s.state.micro_batch_size == before[1] and all(p.grad is None for p in s.params)


# ---- checkpoints ---------------------------------------------------------------------------------------
def tiny_checkpoint(parent: Path, step: int) -> Path:
    """A checkpoint written as a run writes it, with the fault harness's halfway hook (a no-op without faults)."""
    return save_checkpoint(parent / f"step_{step:06d}", step, {"unet.w": torch.full((8,), float(step))},
                           {"train": {"step": step}}, halfway=faults.during_checkpoint_write)


def test_full_disk_is_a_clear_error_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    import shutil as real_shutil

    from stabletune_core.train import checkpoint

    tiny_checkpoint(tmp_path, 1)
    usage = real_shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    with pytest.raises(CheckpointError, match="Not enough disk space.*last good checkpoint is kept"):
        tiny_checkpoint(tmp_path, 2)
    monkeypatch.undo()
    faults.install("disk_full@save:3")
    try:
        with pytest.raises(CheckpointError, match="No space left on device.*last good checkpoint is kept"):
            tiny_checkpoint(tmp_path, 3)
    finally:
        faults.install(None)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000001"]
    assert latest_good_checkpoint(tmp_path).adapter["unet.w"][0] == 1
    assert not list(tmp_path.glob(".tmp_*"))


def test_keep_last_n_plus_best_and_never_the_last_good_one(tmp_path):
    for step in range(1, 7):
        tiny_checkpoint(tmp_path, step)
    removed = prune_checkpoints(tmp_path, 2, protect={tmp_path / "step_000002"})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000005", "step_000006"]
    assert [p.name for p in removed] == ["step_000001", "step_000003", "step_000004"]
    for step in (7, 8, 9):
        tiny_checkpoint(tmp_path, step)
    for step in (8, 9):  # the two newest are corrupt: the newest good one (7) must survive pruning
        (tmp_path / f"step_{step:06d}" / "state.pt").write_bytes(b"garbage")
    prune_checkpoints(tmp_path, 2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000007", "step_000008", "step_000009"]
    messages = []
    assert latest_good_checkpoint(tmp_path, report=messages.append).step == 7
    assert len(messages) == 2 and "sha256" in messages[0]


def test_saving_the_same_step_again_replaces_it_whole_and_stale_temporaries_go(tmp_path):
    tiny_checkpoint(tmp_path, 4)
    save_checkpoint(tmp_path / "step_000004", 4, {"unet.w": torch.zeros(8)}, {"train": {"step": 4}})
    assert load_checkpoint(tmp_path / "step_000004").adapter["unet.w"].sum() == 0
    dead = tmp_path / ".tmp_step_000005_999999999"
    mine = tmp_path / f".tmp_step_000006_{os.getpid()}"
    dead.mkdir(), mine.mkdir()
    assert remove_stale_temporaries(tmp_path) == [dead]
    assert mine.exists() and [p.name for p in list_checkpoints(tmp_path)] == ["step_000004"]


# ---- metrics across resumes ----------------------------------------------------------------------------
def test_metrics_reader_keeps_the_latest_timeline(tmp_path):
    lines = [{"step": s, "loss": f"dead{s}"} for s in (1, 2, 3, 4, 5)]  # died at 5, checkpoint at 3
    lines += [{"step": s, "loss": f"new{s}"} for s in (4, 5, 6)]
    assert [r["loss"] for r in latest_timeline(lines)] == ["dead1", "dead2", "dead3", "new4", "new5", "new6"]
    path = tmp_path / "metrics.jsonl"
    reader = RunReader(tmp_path)
    path.write_text("".join(json.dumps(r) + "\n" for r in lines[:5]))
    assert [r["step"] for r in reader.metrics()] == [1, 2, 3, 4, 5]
    with open(path, "a") as f:  # the resumed process appends; the reader reads incrementally
        f.write("".join(json.dumps(r) + "\n" for r in lines[5:]))
    assert [r["loss"] for r in reader.metrics()] == ["dead1", "dead2", "dead3", "new4", "new5", "new6"]


# ---- GPU only ------------------------------------------------------------------------------------------
@cuda
def test_sampling_does_not_leak_vram(tiny_config):
    from stabletune_core.train.loop import sample, setup

    s = setup(tiny_config(validation_prompt="a red circle", num_validation_images=1, validation_inference_steps=2))
    sample(s)
    after_first = torch.cuda.memory_allocated()
    for _ in range(3):
        sample(s)
    assert torch.cuda.memory_allocated() <= after_first + 2**20


@cuda
def test_fp16_divergence_falls_back_and_finishes_finite(tiny_config, tmp_path, injected):
    """fp16 at a huge rate: a plain loop ends in NaN weights; the guarded run falls back and stays finite."""
    from stabletune_core.train.loop import setup, train

    def run(name: str, guarded: bool):
        config = tiny_config(max_train_steps=30, learning_rate=1.0, mixed_precision="fp16", clip_mode="off",
                             nan_guard=guarded, fp16_fallback=guarded, fp16_max_skips=3,
                             output_dir=str(tmp_path / name))
        s = setup(config)
        train(config, session=s)
        return s

    plain = run("plain", False)
    assert any(not torch.isfinite(p).all() for p in plain.params)
    guarded = run("guarded", True)
    assert all(torch.isfinite(p).all() for p in guarded.params)
    assert events_of(tmp_path / "guarded", "precision") or events_of(tmp_path / "guarded", "rollback")


@cuda
def test_preflight_finds_the_largest_micro_batch_on_gpu(tiny_config):
    from stabletune_core.train.loop import run_preflight, setup

    report = run_preflight(setup(tiny_config()))
    assert report["largest_micro_batch"] >= 1 and report["step_peak_mb"] > 0 and report["sampling_peak_mb"] > 0
