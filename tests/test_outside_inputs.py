"""Bad input found from outside (issue 37 items 9, 11, 16, 17): each reproduced the way a user meets it, through
the CLI in a real subprocess on the tiny model, judged by what the user sees (exit code, the one `error:` sentence,
status.json, the files)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_failures import ROOT, TIMEOUT, assert_failed, base_flags, environment, status, train, tree_hash
from test_failures_features import finished_run  # noqa: F401  (a fixture: a finished 3-step run)

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


# ---- item 11: export on a full disk -------------------------------------------------------------------------------


# The copy into RUN/output meets a full disk half-way: the first half of the bytes reach the file, then ENOSPC (as
# the kernel does when the disk fills during a write).
EXPORT_DISK_FULL = """
import errno, os, sys
real_sendfile, real_write = os.sendfile, os.write
def _into_output(fd):
    return "/output/" in os.readlink(f"/proc/self/fd/{fd}")
def sendfile(out_fd, in_fd, offset, count):
    if _into_output(out_fd):
        real_sendfile(out_fd, in_fd, offset, max(1, count // 2))
        raise OSError(errno.ENOSPC, "No space left on device")
    return real_sendfile(out_fd, in_fd, offset, count)
def write(fd, data):
    if _into_output(fd):
        real_write(fd, bytes(data)[: max(1, len(data) // 2)])
        raise OSError(errno.ENOSPC, "No space left on device")
    return real_write(fd, data)
os.sendfile, os.write = sendfile, write
from stabletune_core.cli import main
sys.exit(main(["export", *sys.argv[1:]]))
"""


def _loads(path: Path) -> bool:
    from safetensors.torch import load_file

    return bool(load_file(path))


def test_export_on_a_full_disk_leaves_nothing_and_the_retry_writes_the_lora(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    checkpoint = run / "checkpoints" / "step_000002"
    before = sorted(p.name for p in (run / "output").iterdir())
    full = cli(str(checkpoint), entry=[sys.executable, "-c", EXPORT_DISK_FULL])
    sentence = assert_failed(full, None, "The disk is full", code=1)
    assert "export again" in sentence and len(sentence) < 300
    assert sorted(p.name for p in (run / "output").iterdir()) == before  # no truncated LoRA, no temporary
    retry = cli("export", str(checkpoint))
    assert retry.returncode == 0, retry.stderr[-3000:]
    assert _loads(run / "output" / "lora_step000002.safetensors")


def test_export_into_a_real_full_file_system_then_after_freeing_space(finished_run, tmp_path):
    """The same on a real full disk: a tmpfs mounted over RUN/output in a private mount namespace (unshare), filled
    to the last byte, then emptied for the retry."""
    if not shutil.which("unshare"):
        pytest.skip("no unshare to mount a private tmpfs")
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    checkpoint = run / "checkpoints" / "step_000002"
    output = run / "output"
    script = f"""
set -u
mount -t tmpfs -o size=256k tmpfs {output} || exit 77
dd if=/dev/zero of={output}/filler bs=4k 2>/dev/null
"{sys.executable}" -m stabletune_core export {checkpoint} >/dev/null 2>{tmp_path}/err; echo "FULL-RC $?"
echo "FULL-ERR $(grep '^error: ' {tmp_path}/err)"
echo "AFTER $(ls -A {output} | tr '\\n' ' ')"
rm {output}/filler
"{sys.executable}" -m stabletune_core export {checkpoint} >/dev/null 2>&1; echo "RETRY-RC $?"
"{sys.executable}" -c "from safetensors.torch import load_file; print('KEYS', len(load_file('{output}/lora_step000002.safetensors')))"
"""
    result = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, env=environment(), capture_output=True,
                            text=True, timeout=TIMEOUT)
    if result.returncode == 77 or "FULL-RC" not in result.stdout:
        pytest.skip(f"cannot mount a private tmpfs here: {result.stderr[-300:]}")
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in result.stdout.splitlines() if " " in line}
    assert lines["FULL-RC"].strip() == "1" and "The disk is full" in lines["FULL-ERR"], result.stdout
    assert lines["AFTER"].split() == ["filler"], result.stdout  # no truncated LoRA, no temporary
    assert lines["RETRY-RC"].strip() == "0", result.stdout + result.stderr
    assert int(lines["KEYS"]) > 0, result.stdout


# ---- item 16: masks white only outside the crop; a training folder inside the class-image folder ------------------
def _masks_white_outside_the_centre_crop(data: Path) -> None:
    """A wide image (96x64) trains its centre 64x64 at resolution 64: its mask is white in the left 16 columns only."""
    from PIL import Image

    for image in sorted(data.glob("*.png")):
        with Image.open(image) as opened:
            opened.convert("RGB").resize((96, 64)).save(image)
        mask = Image.new("L", (96, 64), 0)
        mask.paste(255, (0, 0, 12, 64))
        mask.save(image.with_name(image.stem + ".mask.png"))


def test_masks_white_only_outside_the_crop_are_refused_before_training(tiny_model, shapes_dataset, tmp_path):
    data = copy_dataset(shapes_dataset, tmp_path / "data")
    _masks_white_outside_the_centre_crop(data)
    before = tree_hash(data)
    run = tmp_path / "run"
    result = train(base_flags(tiny_model, data, run) + ["--masked_loss", "--center_crop", "--no-enable_bucket",
                                                        "--max_train_steps", "2"])
    sentence = assert_failed(result, run, "white only outside the centre crop", code=1)
    assert len(sentence) < 300 and "center_crop" in sentence and "masked_loss" in sentence
    assert "Loaded model" not in result.stderr  # before the model loads
    assert not list(run.glob("output/*")) and tree_hash(data) == before


def test_a_training_folder_inside_the_class_image_folder_is_refused(tiny_model, shapes_dataset, tmp_path):
    classes = copy_dataset(shapes_dataset, tmp_path / "class")
    data = copy_dataset(shapes_dataset, classes / "1_mine")
    before = tree_hash(classes)
    run = tmp_path / "run"
    result = train(base_flags(tiny_model, data, run) + ["--reg_data_dir", str(classes)])
    sentence = assert_failed(result, run, "inside the regularisation folder", code=2)
    assert sentence.count(str(data)) == 1 and len(sentence) < 300
    assert tree_hash(classes) == before


# ---- item 17: one sentence each, under ~300 characters, the path once ----------------------------------------------
def _unreadable(folder: Path, count: int) -> Path:
    folder.mkdir(parents=True)
    for n in range(count):
        (folder / f"broken_image_number_{n:03d}.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    return folder


def test_the_class_image_and_all_black_mask_sentences_are_short(tiny_model, shapes_dataset, tmp_path):
    deep = tmp_path / "class images for my subject"
    classes = _unreadable(deep, 8)
    run = tmp_path / "run-reg"
    result = train(base_flags(tiny_model, shapes_dataset, run) + ["--reg_data_dir", str(classes)])
    sentence = assert_failed(result, run, "Class-image folder", code=1)
    assert len(sentence) - len(str(classes)) < 230 and sentence.count(str(classes)) == 1, (len(sentence), sentence)
    assert "broken_image_number_000.png" in sentence and "all 8" in sentence

    from PIL import Image

    data = copy_dataset(shapes_dataset, deep.parent / "training images")
    for image in sorted(data.glob("*.png")):
        with Image.open(image) as opened:
            Image.new("L", opened.size, 0).save(image.with_name(image.stem + ".mask.png"))
    run = tmp_path / "run-masks"
    result = train(base_flags(tiny_model, data, run) + ["--masked_loss"])
    sentence = assert_failed(result, run, "all black", code=1)
    assert len(sentence) - len(str(data)) < 230 and sentence.count(str(data)) == 1, (len(sentence), sentence)
    assert "masked_loss" in sentence
