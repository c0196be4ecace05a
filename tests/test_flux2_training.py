"""Issue 23: FLUX.2 Klein trains through the engine, from the command line, with the stability promise of the SD
families (item 4), on the tiny real-layout Klein (models/tiny_flux2.py, built offline).

Every run here is the real `python -m stabletune_core train` (or the loop in-process where only the loop's
behaviour is looked at); the SD tests' helpers (test_faults.py) drive the processes.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flux2_tools import one_sentence, tiny_klein_paths
from stabletune_core.config import build_config
from stabletune_core.config.families import KLEIN_LORA_TARGETS
from stabletune_core.models.flux2_klein import LORA_PRESETS
from stabletune_core.runs.reader import RunReader

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 900


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return tiny_klein_paths(tmp_path_factory)


def cli(*args: str, faults: str = "") -> subprocess.CompletedProcess:
    from test_faults import environment

    return subprocess.run([sys.executable, "-m", "stabletune_core", "train", *args], cwd=ROOT,
                          env=environment(faults), capture_output=True, text=True, timeout=TIMEOUT)


def small_args(model: Path, data: Path, run: Path, **overrides) -> list[str]:
    values = dict(pretrained_model_name_or_path=model, train_data_dir=data, output_dir=run, resolution=64,
                  bucket_step=8, min_bucket_reso=32, max_bucket_reso=128, train_batch_size=2, learning_rate=1e-3,
                  max_train_steps=4, lora_rank=4, save_precision="fp32", validation_split=0, seed=5)
    values.update(overrides)
    args = []
    for key, value in values.items():
        if value is True:
            args.append(f"--{key}")
        else:
            args += [f"--{key}", str(value)]
    return args


# ---- item 1: the family in the config, knobs that do not apply refused before any model loads ---------------------
def test_klein_lora_targets_are_the_familys_preset():
    assert KLEIN_LORA_TARGETS == LORA_PRESETS["attention"]  # config/families.py cannot import the torch side


@pytest.mark.parametrize("family, knob, value", [
    ("flux2_klein", "snr_gamma", "5"),
    ("flux2_klein", "prediction_type", "v_prediction"),
    ("flux2_klein", "down_lr_scale", "0.5"),
    ("auto", "train_text_encoder", True),  # the family detected from the checkpoint, before it loads
    ("auto", "validation_sampler", "euler_a"),
    ("sd1", "weighting_scheme", "logit_normal"),
    ("sdxl", "flow_shift", "3.0"),
])
def test_knobs_of_another_family_are_refused_in_one_sentence(paths, shapes_dataset, tmp_path, family, knob, value):
    run = tmp_path / "run"
    done = cli(*small_args(paths["folder"], shapes_dataset, run, model_family=family, **{knob: value}))
    assert done.returncode != 0
    error = done.stderr.strip().splitlines()[-1].removeprefix("error: ")
    assert knob in error and one_sentence(error), done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Loading weights" not in done.stderr  # refused before loading
    status = RunReader(run).status()
    assert status["state"] == "failed" and status["error"] == error
