"""Your own concept, as a user does it (issue 35.4): `demo --concept-images FOLDER --concept-word WORD` teaches the toy
base a colour from the user's images, with the base's own prior images and validation prompts that name the word.

Bad input is one sentence before anything is built or loaded; the end-to-end run is a short one on the toy base.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from stabletune_core.toy.world import SHAPES, Scene, write_dataset

ROOT = Path(__file__).resolve().parent.parent
BLUE = (40, 90, 220)  # a colour the toy base never saw, drawn by the toy world as a user's own images would be


def blue_images(folder: Path, count: int = 12) -> Path:
    """`count` blue shapes drawn by the toy world, each with its caption 'a blue <shape>'."""
    return write_dataset(folder, [Scene("blue", SHAPES[i % 3], 9000 + i, rgb=BLUE) for i in range(count)])


def run_demo(argv: list[str], cache: Path) -> tuple[int, str, str]:
    env = {**os.environ, "STABLETUNE_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "stabletune_core", "demo", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    return done.returncode, done.stdout, done.stderr


def folder_digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def bad_inputs(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (demo flags, what the one sentence must say)."""
    images = blue_images(tmp / "blue")
    (tmp / "empty").mkdir()
    (tmp / "texts").mkdir()
    (tmp / "texts" / "notes.txt").write_text("a blue circle")
    (tmp / "broken").mkdir()
    (tmp / "broken" / "a.png").write_bytes(b"not an image")
    wrong_caption = blue_images(tmp / "wrong")
    next(wrong_caption.glob("*.txt")).write_text("a navy circle")
    return {
        "missing folder": (["--concept-images", str(tmp / "nowhere"), "--concept-word", "blue"], "is not a folder"),
        "empty folder": (["--concept-images", str(tmp / "empty"), "--concept-word", "blue"], "holds no images"),
        "no images": (["--concept-images", str(tmp / "texts"), "--concept-word", "blue"], "holds no images"),
        "not an image": (["--concept-images", str(tmp / "broken"), "--concept-word", "blue"],
                         "is not a readable image"),
        "two words": (["--concept-images", str(images), "--concept-word", "deep blue"], "is not one plain word"),
        "a known colour": (["--concept-images", str(images), "--concept-word", "red"], "already draws"),
        "a shape": (["--concept-images", str(images), "--concept-word", "circle"], "toy world's own words"),
        "capitals": (["--concept-images", str(images), "--concept-word", "Blue"], "lowercase"),
        "word alone": (["--concept-word", "blue"], "needs both"),
        "images alone": (["--concept-images", str(images)], "needs both"),
        "a caption without the word": (["--concept-images", str(wrong_caption), "--concept-word", "blue"],
                                       "does not name 'blue'"),
        "with the shape demo": (["--concept", "shape", "--concept-images", str(images), "--concept-word", "blue"],
                                "leave --concept out"),
    }


def test_bad_concept_input_is_one_sentence_before_anything_is_built(tmp_path, monkeypatch, capsys):
    from stabletune_core.cli import run_command

    cache = tmp_path / "cache"
    monkeypatch.setenv("STABLETUNE_CACHE", str(cache))
    for name, (flags, says) in bad_inputs(tmp_path).items():
        code = run_command(["demo", *flags, "--output_dir", str(tmp_path / "run")])
        err = capsys.readouterr().err.strip()
        assert code == 2, (name, err)
        assert err.startswith("error: ") and "\n" not in err and len(err) < 300, (name, err)
        assert says in err, (name, err)
        assert "Traceback" not in err and "internal error" not in err, (name, err)
    assert not cache.exists() and not (tmp_path / "run").exists()  # nothing built, nothing loaded


def test_bad_concept_input_from_the_command_line_is_one_sentence(tmp_path):
    """The same as a user types it: one sentence on stderr, exit code 2, before torch is imported."""
    code, out, err = run_demo(["--concept-images", str(tmp_path / "nowhere"), "--concept-word", "blue",
                               "--output_dir", str(tmp_path / "run")], tmp_path / "cache")
    assert code == 2 and err.strip() == (f"error: --concept-images {tmp_path / 'nowhere'} is not a folder: give the "
                                         "folder that holds your images.")
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()


def test_the_validation_prompts_name_the_word_and_keep_the_presets_kept_prompts():
    from stabletune_core.config import read_toml
    from stabletune_core.demo import PRESETS, word_validation_prompts

    preset = read_toml(PRESETS / "demo.toml")["validation_prompt"]
    prompts = word_validation_prompts(preset, "blue").split(" | ")
    assert prompts[:3] == ["a blue circle", "a blue square", "a blue triangle"]
    assert prompts[3:] == [p for p in preset.split(" | ") if "purple" not in p]


def test_your_own_concept_end_to_end_on_the_toy_base(tmp_path):
    """A user's folder of 12 blue shapes (half without captions: the demo writes 'a blue <shape>' from what the toy
    judge sees), the word 'blue' and a training seed: a short run on the toy base trains from a copy of the images
    beside the base's own prior images, validates on prompts naming the word, prints the learning summary, and
    leaves the user's folder as it was."""
    images = blue_images(tmp_path / "my blue shapes")
    for caption in sorted(images.glob("*.txt"))[::2]:
        caption.unlink()
    before = folder_digest(images)
    run = tmp_path / "runs" / "blue"
    code, out, err = run_demo(["--concept-images", str(images), "--concept-word", "blue", "--seed", "3",
                               "--max-train-steps", "8", "--output_dir", str(run)], tmp_path / "cache")
    assert code == 0, err[-3000:]
    assert folder_digest(images) == before  # the user's images are only read
    config = tomllib.loads((run / "config.toml").read_text())
    assert config["seed"] == 3 and config["output_name"] == "demo_blue_lora"
    assert config["validation_prompt"].startswith("a blue circle | a blue square | a blue triangle | ")
    data = Path(config["train_data_dir"])
    assert data != images and images not in data.parents
    concept = sorted((data / "1_blue").glob("*.png"))
    assert [p.name for p in concept] == sorted(p.name for p in images.glob("*.png"))
    for path in concept:  # every image captioned with the word and the shape it shows
        shape = path.stem.split("_")[1]
        assert path.with_suffix(".txt").read_text() == f"a blue {shape}"
    assert len(list((data / "1_known_colours").glob("*.png"))) == 24  # the base's own images, 2 per base prompt
    assert (run / "output" / "demo_blue_lora.safetensors").is_file()
    console = out + err
    assert "learns blue from" in console
    summary = re.search(r"Learning summary \(.*?\): (.*)\.$", console, re.M)
    assert summary, console[-2000:]
    assert summary.group(1).startswith("blue: ")  # the word's hue error against the user's own images
    meta = json.loads((run / "samples" / "step_000000" / "prompts.json").read_text())
    assert meta["seeds"][0] == 3 and meta["prompts"][0] == "a blue circle"
