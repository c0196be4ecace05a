"""Bad input found from outside (issue 37 items 9, 11, 16, 17): each reproduced the way a user meets it, through
the CLI in a real subprocess on the tiny model, judged by what the user sees (exit code, the one `error:` sentence,
status.json, the files)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from test_failures import ROOT, TIMEOUT, assert_failed, base_flags, environment, status, train, tree_hash

LONG_STEM = "あ" * 83  # 249 bytes of UTF-8: with .png 253, under the 255-byte limit; with .mask.png 258, over it


def cli(*args: str, entry: list[str] | None = None) -> subprocess.CompletedProcess:
    entry = entry or [sys.executable, "-m", "stabletune_core"]
    return subprocess.run([*entry, *args], cwd=ROOT, env=environment(), capture_output=True, text=True,
                          timeout=TIMEOUT)


def copy_dataset(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


# ---- item 9: an image named near the file system's limit ----------------------------------------------------------
def test_an_image_named_near_the_name_limit_trains_and_the_doctor_says_where_its_mask_goes(tiny_model,
                                                                                         shapes_dataset, tmp_path):
    data = copy_dataset(shapes_dataset, tmp_path / "data")
    first = sorted(data.glob("*.png"))[0]
    first.rename(data / f"{LONG_STEM}.png")
    first.with_suffix(".txt").rename(data / f"{LONG_STEM}.txt")
    before = tree_hash(data)
    run = tmp_path / "run"
    result = train(base_flags(tiny_model, data, run) + ["--max_train_steps", "2"])  # default settings
    assert result.returncode == 0, result.stderr[-3000:]
    assert status(run)["state"] == "finished"
    assert tree_hash(data) == before

    doctor = cli("doctor", str(data), "--resolution", "64")
    assert doctor.returncode == 0, doctor.stderr[-3000:]
    assert "1 image name(s) are too long for a mask file beside them" in doctor.stdout
    assert "masks/NAME.png" in doctor.stdout

    # its mask in masks/ is found and trains (the run reads it and says so); the caption tools can rewrite its caption
    from PIL import Image

    (data / "masks").mkdir()
    with Image.open(data / f"{LONG_STEM}.png") as image:
        Image.new("L", image.size, 255).save(data / "masks" / f"{LONG_STEM}.png")
    masked = tmp_path / "masked"
    result = train(base_flags(tiny_model, data, masked) + ["--max_train_steps", "1", "--masked_loss"])
    assert result.returncode == 0, result.stderr[-3000:]
    messages = [json.loads(line)["message"] for line in (masked / "events.jsonl").read_text().splitlines()]
    assert any(m.startswith("1 of ") and "have a loss mask" in m for m in messages), messages

    from stabletune_core.data import write_caption

    assert write_caption(data / f"{LONG_STEM}.png", "a new caption").read_text() == "a new caption\n"
