"""Issue 36 item 4: the quality and speed cost of base_storage on the toy demos (bench/storage_quality.py): a slice
runs end to end on the toy SD 1.x base and writes its table, each storage's measures beside full storage's; a
storage that needs a GPU is refused in one sentence."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parent.parent


def test_storage_quality_runs_a_slice_and_puts_each_storage_beside_full(tmp_path, toy_cache, toy_base):
    bench = load_bench("storage_quality")
    out = tmp_path / "sq"
    env = {**os.environ, "STABLETUNE_CACHE": str(toy_cache), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "bench/storage_quality.py", "--out", str(out), "--families", "sd1",
                           "--storages", "full,int8", "--steps", "3", "--render-seeds", "1", "--speed-rounds", "1",
                           "--speed-steps", "3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (out / "table.md").read_text().splitlines()
    assert lines[0] == "| " + " | ".join(bench.COLUMNS) + " |" and len(lines) == 4
    full, int8 = (json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines())
    assert (full["storage"], int8["storage"]) == ("full", "int8") and full["steps"] == 3
    cells = [c.strip() for c in lines[3].strip("|").split("|")]
    assert cells[:4] == ["sd1", "int8", "7", "3"]
    assert cells[5] == f"{int8['after'] - full['after']:+.1f} deg"  # the concept error beside full's
    assert cells[7] == f"{max(int8['drift'].values()) - max(full['drift'].values()):+.1f} deg"
    assert cells[-1].startswith("x") and float(cells[-2]) > 0  # s/step, and its ratio to full's
    assert (out / "sd1" / "runs" / "purple-seed7-int8" / "output" / "purple_lora.safetensors").is_file()
    events = (out / "sd1" / "runs" / "purple-seed7-int8" / "events.jsonl").read_text().splitlines()
    # the run stored its base in int8 (setup.py's placement event)
    assert [e["layers"] for e in map(json.loads, events) if e.get("base_storage") == "int8"][0] > 0


def test_a_storage_that_needs_a_gpu_is_one_sentence():
    done = subprocess.run([sys.executable, "bench/storage_quality.py", "--out", "/nonexistent", "--storages",
                           "full,fp8"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "base_storage 'fp8' does not run on a CPU here" in done.stderr
