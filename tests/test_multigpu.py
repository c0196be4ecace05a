"""Several processes through `accelerate launch`, for real: 2 CPU processes talking gloo.

One reference run in this process (1 process, batch 2 x accumulation 2) against the same global batch on
2 processes (batch 2 each): a 1-process checkpoint is resumed on 2 processes, and a 2-process checkpoint is
resumed on 1 process. Losses and final LoRA weights must match the uninterrupted single-process run.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stabletune_core.config import build_config
from stabletune_core.launch import engine_env, train_command

ROOT = Path(__file__).resolve().parent.parent
STEPS = 6

# accelerate's multi-GPU launcher is torchrun; with ACCELERATE_USE_CPU the processes join a gloo group on the CPU.
ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_machines: 1
machine_rank: 0
mixed_precision: 'no'
gpu_ids: all
rdzv_backend: static
same_network: true
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(tiny_model, shapes_dataset, run_dir: Path, **overrides):
    values = dict(pretrained_model_name_or_path=str(tiny_model), train_data_dir=str(shapes_dataset),
                  output_dir=str(run_dir), resolution=64, bucket_step=8, min_bucket_reso=32, max_bucket_reso=128,
                  train_batch_size=2, gradient_accumulation_steps=2, learning_rate=2e-3, max_train_steps=STEPS,
                  lora_rank=4, lora_alpha=8, save_steps=2, seed=11, save_precision="fp32", lora_dropout=0.0)
    values.update(overrides)
    return build_config(values)


def _metrics(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines]
    assert len({m["step"] for m in steps}) == len(steps), "a step was logged twice (two writers?)"
    return {m["step"]: m["loss"] for m in steps}


def _events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines()) if e["kind"] == kind]


def _assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same LoRA up to float summation order. Elementwise closeness is the wrong test: Adam divides by
    sqrt(v), so a weight whose gradient is ~0 moves by up to lr on a rounding difference (in the tiny model
    the mid block sees a 1x1 latent, so its self-attention keys get exactly zero gradient and train on
    noise). What must match is the adapter as a whole: the lora_up tensors start at zero, so their joint
    norm is the training update itself, and the difference must be under 1% of it."""
    ups = [k for k in want if k.endswith("lora_up.weight")]
    diff = torch.cat([(got[k] - want[k]).flatten() for k in ups]).norm()
    update = torch.cat([want[k].flatten() for k in ups]).norm()
    assert update > 1e-2 and diff <= 1e-2 * update, (float(diff), float(update))
    for key in want:
        if key.endswith(".alpha"):
            assert torch.equal(got[key], want[key]), key


def _copy_checkpoint(src_run: Path, step: int, dst_run: Path) -> None:
    name = f"step_{step:06d}"
    shutil.copytree(src_run / "checkpoints" / name, dst_run / "checkpoints" / name)


def _launch_two_processes(config, tmp_path: Path) -> subprocess.CompletedProcess:
    config_toml = tmp_path / "two.toml"
    config.save_toml(config_toml)
    accelerate_yaml = tmp_path / "accelerate.yaml"
    accelerate_yaml.write_text(ACCELERATE_CONFIG)
    argv = train_command(config_toml, sys.executable, num_processes=2)  # exactly what the UI spawns
    launch_at = argv.index("accelerate.commands.launch") + 1
    argv[launch_at:launch_at] = ["--config_file", str(accelerate_yaml), "--main_process_port", str(_free_port())]
    env = {**engine_env(), "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def reference(tiny_model, shapes_dataset, tmp_path_factory):
    """The uninterrupted single-process run: losses per step, final LoRA, checkpoints at steps 2 and 4."""
    from stabletune_core.train.loop import train

    run_dir = tmp_path_factory.mktemp("reference") / "run"
    lora = train(_config(tiny_model, shapes_dataset, run_dir))
    return run_dir, _metrics(run_dir), load_file(str(lora))


def test_two_processes_match_one_and_resume_across_process_counts(reference, tiny_model, shapes_dataset, tmp_path):
    from stabletune_core.train.loop import train

    ref_dir, ref_loss, ref_lora = reference
    assert sorted(ref_loss) == list(range(1, STEPS + 1))

    # 1 process -> 2 processes: the step-2 checkpoint of the reference continues on two ranks with the same
    # global batch (2 images x 2 ranks instead of 2 x 2 accumulation).
    two_dir = tmp_path / "two"
    _copy_checkpoint(ref_dir, 2, two_dir)
    two = _config(tiny_model, shapes_dataset, two_dir, gradient_accumulation_steps=1, resume_from_checkpoint="auto")
    done = _launch_two_processes(two, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    # only rank 0 wrote the run directory, and both ranks really trained together
    assert len(_events(two_dir, "processes")) == 1 and _events(two_dir, "processes")[0]["processes"] == 2
    assert len(_events(two_dir, "resumed")) == 1
    assert done.stdout.count("LoRA written to") == 1
    assert sorted(p.name for p in (two_dir / "output").iterdir()) == ["lora.safetensors"]
    two_loss = _metrics(two_dir)
    assert sorted(two_loss) == list(range(3, STEPS + 1))
    for step, loss in two_loss.items():  # the loss is the mean over both ranks, as over the one process's batch
        assert loss == pytest.approx(ref_loss[step], rel=1e-4, abs=1e-6), step
    two_lora = load_file(str(two_dir / "output" / "lora.safetensors"))
    assert set(two_lora) == set(ref_lora)
    _assert_same_weights(two_lora, ref_lora)

    # 2 processes -> 1 process: the 2-rank step-4 checkpoint finishes in this process
    one_dir = tmp_path / "one"
    _copy_checkpoint(two_dir, 4, one_dir)
    lora = train(_config(tiny_model, shapes_dataset, one_dir, resume_from_checkpoint="auto"))
    one_loss = _metrics(one_dir)
    assert sorted(one_loss) == [5, 6]
    for step, loss in one_loss.items():
        assert loss == pytest.approx(ref_loss[step], rel=1e-4, abs=1e-6), step
    _assert_same_weights(load_file(str(lora)), ref_lora)


def test_noise_does_not_depend_on_the_process_count(tiny_config):
    """The per-batch noise generator is keyed by the batch's global place, not by how many batches this
    process drew before; a rank that skips batches draws what one process would have drawn."""
    from stabletune_core.train.loop import noise_generator, setup

    session = setup(tiny_config(max_train_steps=1))
    a = torch.randn(3, generator=noise_generator(session, {"position": (1, 5)}))
    b = torch.randn(3, generator=noise_generator(session, {"position": (1, 5)}))
    c = torch.randn(3, generator=noise_generator(session, {"position": (1, 6)}))
    assert torch.equal(a, b) and not torch.equal(a, c)
