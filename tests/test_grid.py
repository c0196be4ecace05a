"""Issue 25.13: the checkpoint comparison grid (`python -m stabletune_core grid`, stabletune_core/grid.py), on the
tiny model in real processes: its base column is the run's step-0 image, strength 1 at a sampled step is that
step's validation image, strength 0 is the base; it is written once, never over another; and rendering it while
a run trains changes nothing of that run (its LoRA ends bitwise equal, its checkpoints keep their bytes)."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stabletune_core.launch import engine_env, spawn, write_run_config
from stabletune_core.runs.layout import RunPaths

ROOT = Path(__file__).resolve().parent.parent


def values(tiny_model: Path, data: Path, output: Path, **overrides) -> dict:
    base = dict(pretrained_model_name_or_path=str(tiny_model), train_data_dir=str(data), output_dir=str(output),
                resolution=64, bucket_step=8, min_bucket_reso=32, max_bucket_reso=128, train_batch_size=4,
                max_train_steps=6, lora_rank=4, seed=3, save_precision="fp32", validation_loss_every=0,
                validation_prompt="a red circle | a blue square", num_validation_images=1,
                validation_inference_steps=4, validation_steps=3, save_steps=3, learning_rate=5e-3)
    base.update(overrides)
    return base


def grid(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stabletune_core", "grid", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**engine_env(), "OMP_NUM_THREADS": "1"})


def train(config_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "stabletune_core", "train", "--config",
                             str(RunPaths(config_dir).config)], cwd=ROOT, env={**engine_env(), "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def cell(sheet: Image.Image, box: list[int], size: tuple[int, int]) -> np.ndarray:
    return np.asarray(sheet.crop(box).resize(size, Image.NEAREST), dtype=int)


@pytest.fixture(scope="module")
def finished_run(tiny_model: Path, shapes_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = write_run_config(values(tiny_model, shapes_dataset, tmp_path_factory.mktemp("grid") / "run"))
    done = train(run)
    _, err = done.communicate(timeout=300)
    assert done.returncode == 0, err[-2000:]
    return run


def test_grid_cells_are_the_runs_own_images(finished_run: Path) -> None:
    """Base = the step-0 validation image, strength 1 at step N = step N's validation image (same prompt, seed,
    sampler), strength 0 = the base; every cell is where RUN/grids/NAME.json says."""
    done = grid(str(finished_run), "--checkpoints", "3,step_000006", "--strengths", "0,0.5,1", "--name", "check")
    assert done.returncode == 0, done.stderr[-2000:]
    png = finished_run / "grids" / "check.png"
    assert done.stdout.strip().endswith(f"Grid written to {png}")
    meta = json.loads(png.with_suffix(".json").read_text())
    assert meta["state"] == "finished" and meta["done"] == meta["total"] == 1 + 2 * 3  # one seed: base, 2 x 3
    assert meta["checkpoints"] == ["step_000003", "step_000006"] and meta["seeds"] == [3]
    sheet = Image.open(png).convert("RGB")
    compared = 0
    for c in meta["cells"]:
        step = 0 if c["checkpoint"] is None else int(c["checkpoint"].split("_")[1])
        sample = RunPaths(finished_run).sample_dir(step) / f"p{c['prompt']:02d}_s{c['seed']}.png"
        reference = np.asarray(Image.open(sample).convert("RGB"), dtype=int)
        shown = cell(sheet, c["box"], reference.shape[1::-1])
        if c["strength"] in (None, 1.0):
            assert np.abs(shown - reference).max() <= 1, c
            compared += 1
        if c["strength"] == 0.0:
            base = RunPaths(finished_run).sample_dir(0) / f"p{c['prompt']:02d}_s{c['seed']}.png"
            assert np.abs(shown - np.asarray(Image.open(base).convert("RGB"), dtype=int)).max() <= 1, c
    assert compared == 2 * 2 * 2  # prompts x checkpoints x (the base and strength 1 in each row)
    stepped = [c for c in meta["cells"] if c["checkpoint"] == "step_000006" and c["prompt"] == 0 and c["seed"] == 3]
    half, full = (cell(sheet, next(c["box"] for c in stepped if c["strength"] == v), (64, 64)) for v in (0.5, 1.0))
    assert np.abs(half - full).max() > 0  # strength 0.5 is not strength 1

    again = grid(str(finished_run), "--checkpoints", "last", "--name", "check")
    assert again.returncode == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr


@pytest.mark.parametrize("args, says", [
    (["--checkpoints", "9"], "has no checkpoint 9; it has step_000003, step_000006."),
    (["--strengths", "half"], "--strengths must be numbers separated by commas"),
    (["--name", "../up"], "may hold letters, digits, - and _ only"),
])
def test_bad_grid_input_is_one_sentence(finished_run: Path, args: list[str], says: str) -> None:
    done = grid(str(finished_run), *args, timeout=120)
    assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_a_grid_rendered_while_the_run_trains_leaves_it_bitwise_as_it_would_be(tiny_model: Path, shapes_dataset: Path,
                                                                               tmp_path: Path) -> None:
    """The grid reads a checkpoint of a live run in its own process; the run's final LoRA is bitwise the LoRA of
    the same run without a grid, and the checkpoint it read keeps its bytes (an exact resume from it stays exact)."""
    long = dict(max_train_steps=120, save_steps=5, checkpoints_total_limit=1000, validation_prompt="a red circle",
                num_validation_images=1, validation_steps=1000)
    watched = write_run_config(values(tiny_model, shapes_dataset, tmp_path / "watched", **long))
    alone = write_run_config(values(tiny_model, shapes_dataset, tmp_path / "alone", **long))
    trainer = train(watched)
    try:
        first = RunPaths(watched).checkpoint(5)
        deadline = time.time() + 240
        while not (first / "manifest.json").exists():
            assert time.time() < deadline and trainer.poll() is None, "no checkpoint at step 5"
            time.sleep(0.1)
        hashes = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(first.iterdir())}
        rendered = grid(str(watched), "--checkpoints", "5", "--strengths", "0.5,1", "--name", "while-training")
        assert trainer.poll() is None, "the run ended before the grid: it did not render while it trained"
        assert rendered.returncode == 0, rendered.stderr[-2000:]
        _, err = trainer.communicate(timeout=300)
        assert trainer.returncode == 0, err[-2000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
    reference = train(alone)
    _, err = reference.communicate(timeout=300)
    assert reference.returncode == 0, err[-2000:]
    from safetensors.torch import load_file

    import torch

    mine, theirs = (load_file(next((run / "output").glob("*.safetensors"))) for run in (watched, alone))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(first.iterdir())} == hashes
    assert sorted(p.name for p in (watched / "grids").iterdir()) == ["while-training.json", "while-training.png"]
