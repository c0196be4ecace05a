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
                  lora_rank=4, lora_alpha=8, save_steps=2, seed=11, save_precision="fp32", lora_dropout=0.0,
                  validation_split=0.0)  # all 8 images train
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


# Test harness around the engine's CLI, run by each rank: faults for one rank only (STABLETUNE_FAULTS is read
# at import, so it is set before stabletune_core loads), and every rank's adapter saved just before the export,
# so the test can compare what the ranks trained (only rank 0 writes the run directory).
RANK_HARNESS = """\
import os, runpy, sys
rank = os.environ.get("RANK", "0")
if os.environ.get("TEST_FAULTS_RANK" + rank):
    os.environ["STABLETUNE_FAULTS"] = os.environ["TEST_FAULTS_RANK" + rank]
from safetensors.torch import save_file
from stabletune_core.lora.inject import lora_state_dict
from stabletune_core.train import loop

original_export = loop.export

def export(s, name=None, **kw):
    adapters = {f"{prefix}.{key}": value.detach().cpu().contiguous() for prefix, module in s.trained.items()
                for key, value in lora_state_dict(s.ranks.unwrap(module)).items()}
    save_file(adapters, os.path.join(os.environ["TEST_ADAPTER_DIR"], f"rank{rank}.safetensors"))
    return original_export(s, name, **kw)

loop.export = export
sys.argv = ["stabletune_core", *sys.argv[1:]]
runpy.run_module("stabletune_core", run_name="__main__", alter_sys=True)
"""


def _launch_two_processes(config, tmp_path: Path, *, harness: bool = False, rank1_faults: str = "",
                          timeout: int = 600) -> subprocess.CompletedProcess:
    config_toml = tmp_path / "two.toml"
    config.save_toml(config_toml)
    accelerate_yaml = tmp_path / "accelerate.yaml"
    accelerate_yaml.write_text(ACCELERATE_CONFIG)
    argv = train_command(config_toml, sys.executable, num_processes=2)  # exactly what the UI spawns
    launch_at = argv.index("accelerate.commands.launch") + 1
    argv[launch_at:launch_at] = ["--config_file", str(accelerate_yaml), "--main_process_port", str(_free_port())]
    env = {**engine_env(), "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("STABLETUNE_FAULTS", None)
    if harness:
        script = tmp_path / "rank_harness.py"
        script.write_text(RANK_HARNESS)
        module_at = argv.index("-m", launch_at)
        argv[module_at:module_at + 2] = [str(script)]
        env.update(TEST_ADAPTER_DIR=str(tmp_path), TEST_FAULTS_RANK1=rank1_faults)
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _rank_adapters(tmp_path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return load_file(str(tmp_path / "rank0.safetensors")), load_file(str(tmp_path / "rank1.safetensors"))


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
    assert len(_events(two_dir, "resumed_from_checkpoint")) == 1
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
    from stabletune_core.train.setup import setup

    session = setup(tiny_config(max_train_steps=1))
    a = torch.randn(3, generator=session.inputs.generator({"position": (1, 5)}))
    b = torch.randn(3, generator=session.inputs.generator({"position": (1, 5)}))
    c = torch.randn(3, generator=session.inputs.generator({"position": (1, 6)}))
    assert torch.equal(a, b) and not torch.equal(a, c)


# ---- text-encoder training and uneven batches on 2 ranks ------------------------------------------------------
# 8 images in batches of 3 make sampler batches of 3, 3 and 2: a step's two batches are spread one per rank on
# 2 processes, and summed by accumulation on 1 process; some steps give the ranks 3 and 2 images.
UNEVEN = dict(train_batch_size=3, train_text_encoder=True, max_train_steps=4, save_steps=1000)


@pytest.fixture(scope="module")
def uneven_runs(tiny_model, shapes_dataset, tmp_path_factory):
    """(1-process run dir, its LoRA, 2-process run dir, the launch, folder with each rank's adapters)."""
    from stabletune_core.train.loop import train

    one_dir = tmp_path_factory.mktemp("uneven-one") / "run"
    one_lora = load_file(str(train(_config(tiny_model, shapes_dataset, one_dir, **UNEVEN))))
    folder = tmp_path_factory.mktemp("uneven-two")
    two = _config(tiny_model, shapes_dataset, folder / "run", **{**UNEVEN, "gradient_accumulation_steps": 1})
    done = _launch_two_processes(two, folder, harness=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return one_dir, one_lora, folder / "run", done, folder


def test_text_encoder_lora_is_trained_together_on_two_ranks(uneven_runs):
    """The text encoder's LoRA gradients are summed across ranks like the UNet's: both ranks end with the same
    text-encoder (and UNet) adapter, and it is the single-process one."""
    _, one_lora, two_dir, _, folder = uneven_runs
    rank0, rank1 = _rank_adapters(folder)
    te_keys = [k for k in rank0 if k.startswith("te0.") and "lora_B" in k]
    assert te_keys and all(torch.count_nonzero(rank0[k]) for k in te_keys)  # the text encoder really trained
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key
    two_lora = load_file(str(two_dir / "output" / "lora.safetensors"))
    assert any(k.startswith("lora_te") for k in two_lora) and set(two_lora) == set(one_lora)
    _assert_same_weights({k: v for k, v in two_lora.items() if k.startswith("lora_te")},
                         {k: v for k, v in one_lora.items() if k.startswith("lora_te")})
    _assert_same_weights(two_lora, one_lora)


def test_uneven_rank_batches_give_the_global_mean_and_count_true_images(uneven_runs):
    one_dir, _, two_dir, _, _ = uneven_runs
    one = {m["step"]: m for m in map(json.loads, (one_dir / "metrics.jsonl").read_text().splitlines())}
    two = {m["step"]: m for m in map(json.loads, (two_dir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    seen = [one[step]["images_seen"] for step in sorted(one)]
    assert len({b - a for a, b in zip([0, *seen], seen)}) > 1  # some steps really had 5 images, some 6
    assert [two[step]["images_seen"] for step in sorted(two)] == seen
    for step in one:  # the loss (and the gradient: see the weights above) is the mean over the global images
        assert two[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-4, abs=1e-6), step
        assert two[step]["grad_norm"] == pytest.approx(one[step]["grad_norm"], rel=1e-3), step


# ---- out of memory on one rank ---------------------------------------------------------------------------------
def test_oom_on_one_rank_shrinks_the_micro_batch_on_every_rank(tiny_model, shapes_dataset, tmp_path):
    """Rank 1 alone runs out of memory twice at step 2. Every rank learns it through one all-reduce and retries
    with half the micro-batch: the run neither hangs nor splits, and trains as one process with the same global
    batch."""
    from stabletune_core.train.loop import train

    values = dict(train_batch_size=4, max_train_steps=3, save_steps=1000, gradient_accumulation_steps=1)
    two = _config(tiny_model, shapes_dataset, tmp_path / "run", **values)
    done = _launch_two_processes(two, tmp_path, harness=True, rank1_faults="oom@2,oom@2", timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "run"
    ooms = _events(run_dir, "oom")
    assert [(e["old_micro_batch"], e["new_micro_batch"]) for e in ooms] == [(4, 2), (2, 1)]
    # rank 1's own fault message names the micro-batch it ran with: it shrank in step with rank 0
    assert "rank 1:" in ooms[0]["message"] and "micro-batch 4" in ooms[0]["message"]
    assert "rank 1:" in ooms[1]["message"] and "micro-batch 2" in ooms[1]["message"]
    two_metrics = {m["step"]: m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert [two_metrics[k]["micro_batch_size"] for k in (1, 2, 3)] == [4, 1, 1]
    rank0, rank1 = _rank_adapters(tmp_path)
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key

    one_dir = tmp_path / "one"
    lora = train(_config(tiny_model, shapes_dataset, one_dir, **{**values, "gradient_accumulation_steps": 2}))
    one_loss = _metrics(one_dir)
    for step, loss in _metrics(run_dir).items():
        assert loss == pytest.approx(one_loss[step], rel=1e-4, abs=1e-6), step
    _assert_same_weights(load_file(str(run_dir / "output" / "lora.safetensors")), load_file(str(lora)))


# ---- the fp16 fallback on 2 ranks ------------------------------------------------------------------------------
def test_fp16_fallback_switches_every_rank_together(tiny_model, shapes_dataset, tmp_path, monkeypatch):
    """fp16 with each rank's own GradScaler (train/amp.py, not accelerate's). Steps 2 and 3 overflow on both ranks
    (an overflow in the backward reaches every rank through the gradient all-reduce; the injected one comes after
    it, so it is injected on both): both scalers skip, halve and, after fp16_max_skips=2, fall back to fp32 at the
    same step. A rank that had not switched would feed scaled gradients into the all-reduce; the run instead
    trains as one process with the same global batch and the same overflows."""
    from stabletune_core.train import faults
    from stabletune_core.train.loop import train

    overflows = "nan_grad@2,nan_grad@3"
    values = dict(mixed_precision="fp16", fp16_max_skips=2, max_train_steps=5, save_steps=1000)
    monkeypatch.setenv("TEST_FAULTS_RANK0", overflows)
    two = _config(tiny_model, shapes_dataset, tmp_path / "run", **values, gradient_accumulation_steps=1)
    done = _launch_two_processes(two, tmp_path, harness=True, rank1_faults=overflows, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "run"
    assert [e["step"] for e in _events(run_dir, "fp16_overflow")] == [2, 3]
    assert [(e["step"], e["precision"]) for e in _events(run_dir, "precision") if e.get("precision")] == [(3, "no")]
    rank0, rank1 = _rank_adapters(tmp_path)
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key

    faults.install(overflows)
    try:
        lora = train(_config(tiny_model, shapes_dataset, tmp_path / "one", **values))
    finally:
        faults.install(None)
    one_loss = _metrics(tmp_path / "one")
    for step, loss in _metrics(run_dir).items():
        assert loss == pytest.approx(one_loss[step], rel=1e-3, abs=1e-5), step
    _assert_same_weights(load_file(str(run_dir / "output" / "lora.safetensors")), load_file(str(lora)))
