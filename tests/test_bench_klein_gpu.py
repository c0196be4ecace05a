"""bench/klein_gpu.py and bench/gpu_check.sh on a machine without a GPU (issue 23 item 6): the Klein GPU entry's
whole code path as a dry run on the tiny Klein on the CPU (the training step, the batch search, the table, the
written model folder), and the shell script parses and says there is nothing to check."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_dry_run_on_the_cpu_measures_and_writes_a_loadable_klein_folder(tmp_path):
    folder = tmp_path / "model"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "klein_gpu.py"), "--device", "cpu", "--tiny",
                           "--resolutions", "64,128", "--steps", "1", "--max-batch", "2", "--write-model", str(folder),
                           "--json", str(tmp_path / "rows.json")], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["resolution"] for r in rows] == [64, 128]
    for row in rows:
        assert row["it_per_s"] > 0 and row["largest_batch"] == 2 and row["largest_is_lower_bound"]
        assert row["loss"] == row["loss"] and row["loss"] > 0  # a finite flow-matching loss
    assert "| 128 | 1 |" in done.stdout and "≥ 2" in done.stdout
    # the written folder is the base model (no adapters) and StableTune's Klein family reads it
    from stabletune_core.models.flux2_klein.family import looks_like_klein
    from safetensors import safe_open

    assert looks_like_klein(folder)
    with safe_open(str(folder / "transformer" / "diffusion_pytorch_model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    assert keys and not any("lora" in k or "base_layer" in k for k in keys)


def test_the_real_size_on_the_cpu_and_bad_resolutions_are_refused_in_one_sentence():
    for argv, words in ((["--device", "cpu"], "add --tiny"), (["--resolutions", "500"], "multiple of 16")):
        done = subprocess.run([sys.executable, str(ROOT / "bench" / "klein_gpu.py"), *argv], capture_output=True,
                              text=True, timeout=120, cwd=ROOT)
        assert done.returncode != 0 and words in done.stderr and "Traceback" not in done.stderr


def test_gpu_check_parses_and_without_cuda_has_nothing_to_check():
    assert subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_check.sh")]).returncode == 0
    import torch

    if torch.cuda.is_available():  # on a GPU machine the script itself is the check
        return
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0 and "no CUDA device here" in done.stdout
