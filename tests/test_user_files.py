"""Nothing a user made is overwritten or misread (issue 15 items 12-14): an earlier run in --output_dir, a run
folder inside the dataset, kohya repeat folders that are dates, huge or zero."""
from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
from PIL import Image

from stabletune_core.config import check_inputs
from views import view_of
from stabletune_core.data.scan import DataItem, DatasetError, DatasetScan, scan_dataset

ROOT = Path(__file__).resolve().parents[1]


def tree_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path: equal before and after = nothing changed or added."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def train_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stabletune_core", "train", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def one_error(result: subprocess.CompletedProcess) -> str:
    """The refusal: non-zero exit, no traceback, exactly one `error:` sentence on stderr."""
    assert result.returncode != 0, result.stdout[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    return errors[0]


def earlier_run(folder: Path) -> Path:
    """A finished run without checkpoints, as an earlier version of the user's run folder looks."""
    (folder / "output").mkdir(parents=True)
    (folder / "output" / "lora.safetensors").write_bytes(b"an earlier LoRA the user keeps")
    (folder / "config.toml").write_text('learning_rate = 0.5\noutput_name = "lora"\n')
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.123456}) + "\n")
    (folder / "status.json").write_text(json.dumps({"state": "finished", "step": 1}))
    return folder


def save_png(path: Path, size: int = 64) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (size, size), (200, 30, 30)).save(path)


# ---- item 12: an earlier run in --output_dir ------------------------------------------------------------------
def test_earlier_run_without_checkpoints_is_refused_untouched(tiny_model, shapes_dataset, tmp_path):
    run = earlier_run(tmp_path / "run")
    before, data_before = tree_hashes(run), tree_hashes(shapes_dataset)
    error = one_error(train_cli("--pretrained_model_name_or_path", str(tiny_model), "--train_data_dir",
                                str(shapes_dataset), "--output_dir", str(run), "--resolution", "64",
                                "--max_train_steps", "2"))
    assert "already holds an earlier run" in error
    assert "--resume auto" in error and "--overwrite_output_dir" in error and "new --output_dir" in error
    assert tree_hashes(run) == before  # not even its status.json says "failed": that file describes the old run
    assert tree_hashes(shapes_dataset) == data_before


def test_overwrite_output_dir_moves_the_earlier_run_aside(tiny_config, tmp_path, one_thread):
    from stabletune_core.runs.reader import RunReader
    from stabletune_core.train.loop import train

    run = earlier_run(tmp_path / "run")
    before = tree_hashes(run)
    config = tiny_config(max_train_steps=2, overwrite_output_dir=True)
    lora = train(config)
    aside = [p for p in run.iterdir() if p.name.startswith("previous-")]
    assert len(aside) == 1 and tree_hashes(aside[0]) == before  # every earlier file kept, byte for byte
    assert lora == run / "output" / "lora.safetensors" and lora.read_bytes() != b"an earlier LoRA the user keeps"
    assert [m["step"] for m in RunReader(run).metrics()] == [1, 2]  # metrics not mixed with the earlier run's
    assert "0.123456" not in (run / "metrics.jsonl").read_text()


def test_the_old_knob_name_still_works_and_an_own_config_is_no_earlier_run(tiny_config, tmp_path):
    from stabletune_core.config import build_config
    from stabletune_core.train.setup import RunExists, prepare_run_dir

    assert build_config({"overwrite_output": True}).overwrite_output_dir  # old TOMLs and flags keep working
    config = tiny_config()
    config.save_toml(Path(config.output_dir) / "config.toml")  # what the UI writes before starting the engine
    prepare_run_dir(config)
    with pytest.raises(RunExists, match="config.toml of another configuration"):
        prepare_run_dir(tiny_config(learning_rate=0.25))


# ---- item 13: the run folder inside the dataset ---------------------------------------------------------------
def test_output_dir_in_the_dataset_is_refused_before_anything_is_written(tiny_model, shapes_dataset, tmp_path):
    data_before = tree_hashes(shapes_dataset)
    error = one_error(train_cli("--pretrained_model_name_or_path", str(tiny_model), "--train_data_dir",
                                str(shapes_dataset), "--output_dir", str(shapes_dataset), "--resolution", "64"))
    assert "is the dataset folder" in error and "choose an output folder outside it" in error
    assert tree_hashes(shapes_dataset) == data_before  # no status.json, no config.toml among the images


def test_output_dir_inside_the_dataset_is_a_config_problem(tiny_config, shapes_dataset, tmp_path):
    inside = check_inputs(tiny_config(output_dir=str(shapes_dataset / "runs" / "a")))
    assert any("is inside the dataset folder (train_data_dir)" in p for p in inside)
    beside = check_inputs(tiny_config(output_dir=str(shapes_dataset.parent / (shapes_dataset.name + "-run"))))
    assert not any("dataset folder" in p for p in beside)  # a sibling with a common prefix is fine


# ---- item 14: kohya repeat folders ----------------------------------------------------------------------------
def test_date_named_folder_is_refused_with_a_rename(tiny_model, tmp_path):
    data = tmp_path / "data"
    save_png(data / "20240101_shoot" / "a.png")
    data_before = tree_hashes(data)
    error = one_error(train_cli("--pretrained_model_name_or_path", str(tiny_model), "--train_data_dir", str(data),
                                "--output_dir", str(tmp_path / "run"), "--resolution", "64"))
    assert "20,240,101 repeats" in error and "looks like a date" in error and "shoot_20240101" in error
    assert tree_hashes(data) == data_before


def test_repeat_counts_are_bounded_and_zero_is_explained(tmp_path):
    huge = tmp_path / "huge"
    save_png(huge / "999999999_x" / "a.png")
    with pytest.raises(DatasetError, match="999,999,999 repeats.*more than the 1000 allowed.*10_x"):
        scan_dataset(huge)

    mixed = tmp_path / "mixed"
    for name in ("1000_x/a.png", "1000_x/b.png", "0_reg/c.png", "0_reg/d.png", "e.png"):
        save_png(mixed / name)
    scan = scan_dataset(mixed)
    assert {i.path.name: i.repeats for i in scan.items} == {"a.png": 1000, "b.png": 1000, "e.png": 1}
    assert scan.notes == ["Folder 0_reg asks for 0 repeats, so its 2 image(s) are left out (as in kohya's trainer); "
                          "rename it to 1_reg to train them."]
    assert scan.notes[0] in view_of(scan, 64, bucket_step=8).notes  # what the loop writes to events.jsonl

    only_zero = tmp_path / "only_zero"
    save_png(only_zero / "0_x" / "a.png")
    with pytest.raises(DatasetError, match="nothing to train.*0_x.*rename 0_x to 1_x"):
        scan_dataset(only_zero)


def test_epoch_index_is_lazy_in_the_repeats(tmp_path):
    """A sampler over 3 images x a million repeats costs what one over 3 images does, not 3 million entries."""
    items = [DataItem(tmp_path / f"{i}.png", "c", 10**6, 64, 64) for i in range(3)]
    view = view_of(DatasetScan(tmp_path, items=items), 64, bucket_step=8)
    tracemalloc.start()
    started = time.perf_counter()
    sampler = view.sampler(batch_size=2)
    order = sampler.batches_for_epoch(5)
    first, last = order[0], order[len(order) - 1]
    seconds = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(order) == math.ceil(3 * 10**6 / 2) and len(first) == 2 and len(last) == 2
    assert peak < 256 * 1024 and seconds < 1.0, (peak, seconds)

    small = [DataItem(tmp_path / f"{i}.png", "c", r, 64, 64) for i, r in enumerate((5, 1, 3))]
    sampler = view_of(DatasetScan(tmp_path, items=small), 64, bucket_step=8).sampler(batch_size=2)
    for epoch in range(3):  # each image exactly `repeats` times per epoch, a different order each epoch
        drawn = [i for batch in sampler.batches_for_epoch(epoch) for i in batch]
        assert sorted(drawn) == [0] * 5 + [1] + [2] * 3
    assert sampler.batches_for_epoch(0) != sampler.batches_for_epoch(1)
