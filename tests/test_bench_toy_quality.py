"""The pure helpers of bench/toy_quality.py: the peer's copy of the dataset and the budget bookkeeping."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent


def load_bench():
    spec = importlib.util.spec_from_file_location("toy_quality", ROOT / "bench" / "toy_quality.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


bench = load_bench()


def stabletune_dataset(root: Path) -> Path:
    """Two kohya-style sub-folders whose files share a name, as the concept and prior folders can."""
    for folder, caption in (("1_purple", "a purple circle"), ("1_known_colours", "a red circle")):
        (root / folder).mkdir(parents=True)
        Image.new("RGB", (8, 8), "white").save(root / folder / "shape_000.png")
        (root / folder / "shape_000.txt").write_text(caption + "\n")
    return root


def test_imagefolder_has_every_image_with_its_own_caption(tmp_path):
    images = bench.dataset_images(stabletune_dataset(tmp_path / "data"))
    target = bench.write_imagefolder(images, tmp_path / "peer")
    rows = [json.loads(line) for line in (target / "metadata.jsonl").read_text().splitlines()]
    assert sorted(r["text"] for r in rows) == ["a purple circle", "a red circle"]  # priors included, no newline
    assert len({r["file_name"] for r in rows}) == 2  # same file name in two folders: no collision
    for row in rows:
        assert (target / row["file_name"]).is_file()
        folder = row["file_name"].split("__")[0]
        assert row["text"] == (tmp_path / "data" / folder / "shape_000.txt").read_text().strip()


def test_imagefolder_refuses_a_folder_with_files(tmp_path):
    (tmp_path / "peer").mkdir()
    (tmp_path / "peer" / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError):
        bench.write_imagefolder([], tmp_path / "peer")
    assert (tmp_path / "peer" / "mine.txt").read_text() == "keep"


def test_budget_takes_the_furthest_snapshot_written_within_it():
    snaps = [bench.Snapshot(10, 8.0, Path("a")), bench.Snapshot(20, 59.9, Path("b")),
             bench.Snapshot(30, 60.1, Path("c"))]
    assert bench.snapshot_within(snaps, 60).step == 20
    assert bench.snapshot_within(snaps, 120).step == 30
    assert bench.snapshot_within(snaps, 5) is None


def test_snapshot_time_is_its_last_written_file(tmp_path):
    started = 1_000_000.0
    for step, times in ((10, (started + 3, started + 7)), (20, (started + 9, started + 12))):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        for i, when in enumerate(times):
            (folder / f"f{i}").write_text("x")
            os.utime(folder / f"f{i}", (when, when))
    (tmp_path / "checkpoint-30").mkdir()  # empty: still being written, not a snapshot yet
    (tmp_path / "logs").mkdir()
    found = bench.snapshots(tmp_path, r"checkpoint-(\d+)", started)
    assert [(s.step, s.seconds) for s in found] == [(10, 7.0), (20, 12.0)]


def test_budgets_are_minutes_sorted_and_positive():
    assert bench.parse_budgets("4,1,2") == [1.0, 2.0, 4.0]
    for bad in ("", "1,x", "0,1"):
        with pytest.raises(SystemExit):
            bench.parse_budgets(bad)
