"""`caption` (issue 26.1): a WD14-layout ONNX tagger and a transformers captioner (BLIP), both tiny and built
here, write captions beside the images with the options users know from kohya's tagger; existing captions,
unreadable images and bad input are handled as the CLI contract says. Caption quality is not tested."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from stabletune_core.cli import main
from tests.tools_helpers import build_tiny_blip, build_wd14_tagger, read_only, tree_bytes

RED, BLUE = (255, 0, 0), (0, 0, 255)


@pytest.fixture(scope="module")
def tagger(tmp_path_factory) -> Path:
    return build_wd14_tagger(tmp_path_factory.mktemp("wd14") / "wd-tiny-tagger")


@pytest.fixture(scope="module")
def blip(tmp_path_factory) -> Path:
    return build_tiny_blip(tmp_path_factory.mktemp("blip") / "blip-tiny")


@pytest.fixture
def dataset(tmp_path) -> Path:
    root = tmp_path / "data"
    (root / "10_hero").mkdir(parents=True)
    Image.new("RGB", (64, 64), RED).save(root / "red.png")
    Image.new("RGB", (32, 64), RED).save(root / "tall_red.png")  # padded to a white square by the tagger
    Image.new("RGB", (64, 64), BLUE).save(root / "10_hero" / "blue.jpg")
    (root / "10_hero" / "blue.txt").write_text("my old caption\n")
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    return root


def caption(root: Path, model: Path, *flags: str) -> int:
    return main(["caption", str(root), "--model", str(model), *flags])


def test_tagger_writes_tags_in_the_wd14_layout_and_leaves_the_rest(tagger, dataset, capsys):
    broken = (dataset / "broken.png").read_bytes()
    assert caption(dataset, tagger, "--prefix", "mychar") == 0
    out = capsys.readouterr().out
    # BGR input: the red image gets red_theme (RGB order would give blue_theme); underscores become spaces
    # except in short tags (^_^); characters after general tags; the trigger word first.
    assert (dataset / "red.txt").read_text() == ("mychar, red theme, simple background, ^_^, long hair, "
                                                 "hero (series)\n")
    # White padding (not black) is what gives the tall red image its green.
    assert "green theme" in (dataset / "tall_red.txt").read_text()
    assert "green theme" not in (dataset / "red.txt").read_text()
    assert (dataset / "10_hero" / "blue.txt").read_text() == "my old caption\n"  # never over a caption
    assert not (dataset / "10_hero" / "blue.txt.bak").exists()
    assert (dataset / "broken.png").read_bytes() == broken and not (dataset / "broken.txt").exists()
    assert "Captioned 2 image(s)" in out and "1 image(s) already had a caption" in out
    assert "skipped" in out and "broken.png" in out


def test_tagger_options(tagger, dataset):
    assert caption(dataset, tagger, "--threshold", "0.5", "--exclude_tags", "simple background, villain",
                   "--keep_tags", "hero (series), ^_^", "--rating", "--keep_underscores",
                   "--character_threshold", "0.45") == 0
    # threshold 0.5 drops long_hair (0.4); the character threshold 0.45 admits villain (0.5) but it is
    # excluded; kept tags come first in the given order; the rating (argmax: general) comes last.
    assert (dataset / "red.txt").read_text() == "hero_(series), ^_^, red_theme, general\n"
    (dataset / "red.txt").unlink()
    assert caption(dataset, tagger, "--character_first", "--threshold", "0.7", "--character_threshold", "0.95") == 0
    assert (dataset / "red.txt").read_text() == "red theme, ^_^\n"  # no character passes 0.95


def test_overwrite_keeps_every_old_caption_and_append_merges(tagger, dataset):
    blue = dataset / "10_hero" / "blue.txt"
    assert caption(dataset, tagger, "--overwrite", "--threshold", "0.7") == 0
    assert blue.with_name("blue.txt.bak").read_text() == "my old caption\n"
    first = blue.read_text()
    assert first == "blue theme, ^_^, hero (series)\n"
    assert caption(dataset, tagger, "--append", "--threshold", "0.5", "--prefix", "mychar") == 0
    assert blue.with_name("blue.txt.bak2").read_text() == first  # the first backup is never overwritten
    assert blue.read_text() == "mychar, blue theme, ^_^, hero (series), simple background\n"


def test_tagger_refusals_before_anything_is_written(tagger, dataset, tmp_path, capsys):
    before = tree_bytes(dataset)
    assert caption(dataset, tmp_path / "no-such-tagger") == 2
    assert "does not exist" in capsys.readouterr().err
    half = tmp_path / "half"
    half.mkdir()
    (half / "model.onnx").write_bytes((tagger / "model.onnx").read_bytes())
    assert caption(dataset, half) == 2
    assert "no selected_tags.csv" in capsys.readouterr().err
    (half / "selected_tags.csv").write_text("tag_id,name,category,count\n1,only_one,0,5\n")
    assert caption(dataset, half) == 2
    assert "predicts 12 labels but selected_tags.csv lists 1" in capsys.readouterr().err
    assert caption(dataset, tagger, "--overwrite", "--append") == 2
    assert "exclude each other" in capsys.readouterr().err
    with read_only(dataset):
        assert caption(dataset, tagger) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: Cannot write captions in") and "read-only" in err and len(err.splitlines()) == 1
    assert tree_bytes(dataset) == before  # nothing was written or touched


def test_blip_captioner_from_a_local_folder(blip, dataset, capsys):
    assert caption(dataset, blip, "--prefix", "mychar", "--max_new_tokens", "6", "--num_beams", "1",
                   "--device", "cpu") == 0
    text = (dataset / "red.txt").read_text()
    assert text.startswith("mychar, ") and len(text.strip()) > len("mychar, ")
    words = set(text.strip()[len("mychar, "):].replace(",", " ").split())
    assert words and words <= set("a photo of the red blue circle square on white".split())  # the tiny vocab
    assert (dataset / "10_hero" / "blue.txt").read_text() == "my old caption\n"
    assert "Captioned 2 image(s) with the captioner" in capsys.readouterr().out


def test_captioner_refusals_in_a_real_process(dataset, tmp_path):
    """The CLI contract from the outside: a missing model folder, a hub id without --allow_download, and a
    folder that is not a captioner are one sentence each, exit 2, and no file is written."""
    before = tree_bytes(dataset)
    not_captioner = tmp_path / "not-captioner"
    not_captioner.mkdir()
    (not_captioner / "config.json").write_text('{"model_type": "clip_text_model"}')
    cases = [(tmp_path / "missing", "does not exist"), ("Salesforce/blip-image-captioning-base", "--allow_download"),
             (not_captioner, "not an image captioner")]
    for model, words in cases:
        done = subprocess.run([sys.executable, "-m", "stabletune_core", "caption", str(dataset), "--model", str(model)],
                              capture_output=True, text=True, timeout=300, env={"OMP_NUM_THREADS": "1",
                                                                                 "HF_HUB_OFFLINE": "1",
                                                                                 "PATH": "/usr/bin:/bin"})
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], done.stderr
    assert tree_bytes(dataset) == before
