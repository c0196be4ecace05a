"""Fault injection on real training processes (`python -m stabletune_core train`) on the tiny model.

Faults come from STABLETUNE_FAULTS (stabletune_core/train/faults.py): SIGKILL mid-step and mid-checkpoint,
NaN loss and gradients, CUDA out-of-memory, a full disk. The clean reference run and the fault run start in
the background at the beginning and run while the kill/resume chain runs in the foreground.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stabletune_core.config import build_config
from stabletune_core.runs.reader import RunReader
from stabletune_core.train.checkpoint import latest_good_checkpoint, list_checkpoints, load_checkpoint

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 900
STEPS = 6


def write_config(folder: Path, tiny_model: Path, shapes_dataset: Path, **overrides) -> Path:
    """A 6-step run with checkpoints every 2 steps; LoRA dropout and flips on, so every RNG matters, and 8
    images in batches of 2, so the run crosses an epoch boundary."""
    values = dict(pretrained_model_name_or_path=str(tiny_model), train_data_dir=str(shapes_dataset),
                  output_dir=str(folder / "run"), resolution=64, bucket_step=8, min_bucket_reso=32,
                  max_bucket_reso=128, train_batch_size=2, learning_rate=1e-3, max_train_steps=STEPS, lora_rank=4,
                  lora_alpha=8, lora_dropout=0.1, random_flip=True, save_steps=2, checkpoints_total_limit=5,
                  seed=11, save_precision="fp32", validation_split=0.0)  # all 8 images train
    values.update(overrides)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.toml"
    build_config(values).save_toml(path)
    return path


def command(config: Path, *, resume: bool = False) -> list[str]:
    return [sys.executable, "-m", "stabletune_core", "train", "--config", str(config),
            *(["--resume", "auto"] if resume else [])]


def environment(faults: str = "") -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TQDM_DISABLE": "1"}
    env.pop("STABLETUNE_FAULTS", None)
    if faults:
        env["STABLETUNE_FAULTS"] = faults
    return env


def run(config: Path, *, faults: str = "", resume: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(command(config, resume=resume), cwd=ROOT, env=environment(faults), capture_output=True,
                          text=True, timeout=TIMEOUT)


def start(config: Path, faults: str = "") -> subprocess.Popen:
    log = open(config.parent / "train.log", "w")
    return subprocess.Popen(command(config), cwd=ROOT, env=environment(faults), stdout=log,
                            stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen, config: Path) -> None:
    rc = process.wait(timeout=TIMEOUT)
    assert rc == 0, (config.parent / "train.log").read_text()[-3000:]


def events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in RunReader(run_dir).events() if e["kind"] == kind]


def lora(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "output" / "lora.safetensors")


@pytest.fixture(scope="module")
def background(tmp_path_factory, tiny_model, shapes_dataset):
    """The clean reference run and the fault run, started once for the module."""
    root = tmp_path_factory.mktemp("faults")
    clean = write_config(root / "clean", tiny_model, shapes_dataset)
    faulty = write_config(root / "faulty", tiny_model, shapes_dataset, nan_window=4, nan_max_bad=2)
    processes = {"clean": (start(clean), clean),
                 "faulty": (start(faulty, "nan_loss@2,nan_grad@3,oom@4,disk_full@save:4"), faulty)}
    yield processes
    for process, _ in processes.values():
        if process.poll() is None:
            process.kill()


def test_killed_mid_step_and_mid_checkpoint_then_resumed_continues_exactly(background, tmp_path, tiny_model,
                                                                           shapes_dataset):
    config = write_config(tmp_path, tiny_model, shapes_dataset)
    run_dir = tmp_path / "run"

    first = run(config, faults="kill@step:3")  # dies between backward and optimizer step of step 3
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    assert RunReader(run_dir).status()["stale"], "a dead process must show as stale"
    assert [c.name for c in list_checkpoints(run_dir / "checkpoints")] == ["step_000002"]

    second = run(config, faults="kill@checkpoint:6", resume=True)  # dies writing the final checkpoint
    assert second.returncode == -signal.SIGKILL, second.stderr[-2000:]
    leftovers = list((run_dir / "checkpoints").glob(".tmp_step_000006_*"))
    assert leftovers and not (run_dir / "checkpoints" / "step_000006").exists()
    good = latest_good_checkpoint(run_dir / "checkpoints")
    assert good.step == 4  # written by the resumed process: its counters continue the first process's
    assert good.state["train"]["step"] == 4 and good.state["train"]["images_seen"] == 8

    third = run(config, resume=True)
    assert third.returncode == 0, third.stderr[-3000:]

    clean_process, clean_config = background["clean"]
    finish(clean_process, clean_config)
    clean_dir = clean_config.parent / "run"
    expected = RunReader(clean_dir).metrics()
    got = RunReader(run_dir).metrics()
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    assert [m["loss"] for m in got] == [m["loss"] for m in expected]  # exactly, step for step
    assert [m["grad_norm"] for m in got] == [m["grad_norm"] for m in expected]
    assert [m["images_seen"] for m in got] == [2 * i for i in range(1, STEPS + 1)]
    assert [m["epoch"] for m in got] == [m["epoch"] for m in expected] and got[-1]["epoch"] == 1
    a, b = lora(clean_dir), lora(run_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    status = RunReader(run_dir).status()
    assert status["state"] == "finished" and status["step"] == STEPS and not status["stale"]
    died = events(run_dir, "previous_died")
    assert [e["step"] for e in died] == [2, 6]  # last heartbeat of each dead process
    resumed = events(run_dir, "resumed_from_checkpoint")
    assert [Path(e["path"]).name for e in resumed] == ["step_000002", "step_000004"]
    assert [e["images_seen"] for e in resumed] == [4, 8]
    assert any("interrupted" in e["message"] for e in events(run_dir, "checkpoint_bad"))
    assert not list((run_dir / "checkpoints").glob(".tmp_*"))
    assert load_checkpoint(run_dir / "checkpoints" / "step_000006").state["train"]["images_seen"] == 12


def test_corrupt_checkpoint_byte_is_detected_and_the_previous_one_used(background, tmp_path):
    """A copy of the finished clean run, its newest checkpoint corrupted by one byte, resumed: the resume must
    report it, fall back to step 4, and redo steps 5-6 exactly as the first time."""
    clean_process, clean_config = background["clean"]
    finish(clean_process, clean_config)
    shutil.copytree(clean_config.parent, tmp_path / "copy")
    config = tmp_path / "copy" / "config.toml"
    run_dir = tmp_path / "copy" / "run"
    config.write_text(config.read_text().replace(str(clean_config.parent), str(config.parent)))
    adapter = run_dir / "checkpoints" / "step_000006" / "adapter.safetensors"
    data = bytearray(adapter.read_bytes())
    data[-5] ^= 0xFF  # one corrupted byte in the weights, size unchanged
    adapter.write_bytes(bytes(data))

    result = run(config, resume=True)
    assert result.returncode == 0, result.stderr[-3000:]
    bad = events(run_dir, "checkpoint_bad")
    assert len(bad) == 1 and "step_000006" in bad[0]["message"] and "sha256" in bad[0]["message"]
    assert Path(events(run_dir, "resumed_from_checkpoint")[0]["path"]).name == "step_000004"
    assert load_checkpoint(run_dir / "checkpoints" / "step_000006").step == 6  # rewritten whole
    expected = RunReader(clean_config.parent / "run").metrics()
    again = RunReader(run_dir).metrics()
    assert [m["loss"] for m in again] == [m["loss"] for m in expected]
    assert again[-1]["time"] > expected[-1]["time"]  # steps 5 and 6 really ran again
    a, b = lora(clean_config.parent / "run"), lora(run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_nan_oom_and_full_disk_injected_run_completes(background):
    process, config = background["faulty"]
    finish(process, config)
    run_dir = config.parent / "run"
    status = RunReader(run_dir).status()
    assert status["state"] == "finished" and status["step"] == STEPS

    nonfinite = events(run_dir, "nonfinite")
    assert [(e["step"], e["what"]) for e in nonfinite] == [(2, "loss"), (3, "gradients")]
    assert all(len(e["paths"]) == 2 and e["tensors"] for e in nonfinite)  # the batch's images, the bad tensors
    assert len(nonfinite[1]["tensors"]) == 1  # nan_grad poisons one tensor, and the event names it
    rollback = events(run_dir, "rollback")
    assert len(rollback) == 1 and rollback[0]["new_lr"] == pytest.approx(rollback[0]["old_lr"] * 0.5)

    oom = events(run_dir, "oom")
    assert [(e["step"], e["old_micro_batch"], e["new_micro_batch"]) for e in oom] == [(4, 2, 1)]
    metrics = RunReader(run_dir).metrics()
    assert [m["micro_batch_size"] for m in metrics] == [2, 2, 2, 1, 1, 1]
    assert [m["images_seen"] for m in metrics] == [2, 4, 6, 8, 10, 12]  # the effective batch stayed 2
    assert all(m["lr"] == pytest.approx(5e-4) for m in metrics[2:])

    failed = events(run_dir, "checkpoint_failed")
    assert len(failed) == 1 and failed[0]["step"] == 4
    assert "No space left on device" in failed[0]["message"] and "last good checkpoint is kept" in failed[0]["message"]
    assert [c.name for c in list_checkpoints(run_dir / "checkpoints")] == ["step_000002", "step_000006"]
    assert latest_good_checkpoint(run_dir / "checkpoints").step == 6
    assert load_checkpoint(run_dir / "checkpoints" / "step_000002").step == 2  # still verifies
    assert not list((run_dir / "checkpoints").glob(".tmp_*"))

    weights = lora(run_dir)
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert any(t.abs().sum() > 0 for k, t in weights.items() if "lora_up" in k)  # it did train
