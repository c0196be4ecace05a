"""The UI places of issue 26: the Dataset tab's caption editor, auto-captioning and doctor, and the LoRA tools tab.
The tab functions run here as the UI runs them (the engine tools in a real subprocess); the browser-level
build of every tab is tests/test_ui_build.py's."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image

from extension import dataset_view
from extension.tabs import dataset as dataset_tab
from extension.tabs import tools as tools_tab
from tests.tools_helpers import build_wd14_tagger


@pytest.fixture
def folder(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("STABLETUNE_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "data"
    root.mkdir()
    for i, colour in enumerate([(255, 0, 0), (0, 0, 255), (200, 10, 10)]):
        Image.new("RGB", (64, 64), colour).save(root / f"img{i}.png")
    (root / "img0.txt").write_text("red, circle\n")
    (root / "img1.txt").write_text("blue, circle\n")
    return root


def items_of(root: Path) -> list[dict]:
    return [{"path": str(p), "caption": dataset_view.captions.read_caption(p.with_suffix(".txt")) or ""}
            for p in sorted(root.glob("*.png"))]


def test_caption_editor_bulk_changes_search_frequency_and_undo(folder):
    items = items_of(folder)
    assert dataset_view.frequency_rows(items, ".txt") == [["circle", 2], ["blue", 1], ["red", 1]]
    assert dataset_view.filter_items(items, "BLUE") == [1] and dataset_view.filter_items(items, "") == [0, 1, 2]
    change = dataset_tab._bulk("add first")
    message, _, items, shown, frequency = change(str(folder), items, ".txt", "circle", "mychar")
    assert message.startswith("add 'mychar' (first): 3 caption(s) changed")
    assert [i["caption"] for i in items] == ["mychar, red, circle", "mychar, blue, circle", "mychar"]
    assert shown == [0, 1] and frequency.values.tolist()[0] == ["mychar", 3]  # the search still filters
    message, *_ = dataset_tab._bulk("replace")(str(folder), items, ".txt", "", "circle", "square")
    assert "2 caption(s) changed" in message and (folder / "img0.txt").read_text() == "mychar, red, square\n"
    message, _, items, _, _ = dataset_tab._bulk("undo")(str(folder), items, ".txt", "")
    assert message == "Undid 'replace 'circle' with 'square'': 2 caption(s) restored."
    assert items[0]["caption"] == "mychar, red, circle"
    message, *_ = dataset_tab._bulk("remove")(str(folder), items, ".txt", "", "")
    assert message == "⚠ Give the tag to remove."


def test_auto_caption_from_the_tab_shows_progress_then_the_new_captions(folder, tmp_path):
    tagger = build_wd14_tagger(tmp_path / "tagger")
    import sys

    ctx = SimpleNamespace(settings=SimpleNamespace(engine_python=sys.executable))
    updates = list(dataset_tab._caption(ctx, str(folder), items_of(folder), ".txt", "", str(tagger), "mychar", 0.5,
                                        0.85, False, "", "", "keep"))
    status = [u[0] for u in updates]
    assert status[0] == "Starting the captioner..." and any("|" in s for s in status[1:-1])  # tqdm's progress line
    assert "Captioned 1 image(s)" in status[-1] and "2 image(s) already had a caption" in status[-1]
    final_items = updates[-1][2]
    assert final_items[2]["caption"].startswith("mychar, red theme")
    assert (folder / "img0.txt").read_text() == "red, circle\n"  # kept
    bad = list(dataset_tab._caption(ctx, str(folder), [], ".txt", "", str(tmp_path / "none"), "", 0.35, 0.85,
                                    False, "", "", "keep"))
    assert bad[-1][0].startswith("⚠ The captioning model folder") and "does not exist" in bad[-1][0]


def test_doctor_from_the_tab(folder):
    import sys

    (folder / "img3.png").write_bytes((folder / "img0.png").read_bytes())
    report = dataset_view.doctor(str(folder), sys.executable, {"resolution": 64, "caption_extension": ".txt"})
    assert report["images"] == 4 and len(report["exact_duplicates"]) == 1
    text = dataset_view.doctor_text(report)
    assert "byte-for-byte copies" in text and "no caption file" in text
    rows, losses = dataset_view.doctor_tables(report)
    assert len(rows) == 4 and rows[0][1] == "64x64" and losses == []
    previews = dataset_view.doctor_previews(report)
    assert len(previews) == 4 and all(Path(p).is_file() for p, _ in previews)
    assert dataset_view.doctor(str(folder / "missing"), sys.executable, {})["error"].startswith("Dataset folder")


def test_lora_tools_tab_builds_the_engine_commands(tmp_path):
    import sys

    assert tools_tab.merge_args("m.safetensors", "a.safetensors:0.7\nb.safetensors", "out.safetensors", "fp16") == [
        "--model", "m.safetensors", "--lora", "a.safetensors:0.7", "b.safetensors", "--output", "out.safetensors",
        "--save_precision", "fp16"]
    assert tools_tab.extract_args("b", "t", 8, 0.9, "x.safetensors")[-2:] == ["--energy", "0.9"]
    ctx = SimpleNamespace(settings=SimpleNamespace(engine_python=sys.executable))
    missing = tmp_path / "none.safetensors"
    lines = list(tools_tab._run(ctx, "merge", tools_tab.combine_args(f"{missing}\n{missing}", 4,
                                                                     str(tmp_path / "o.safetensors"))))
    assert lines[0] == "Running `merge`..." and lines[-1].startswith("⚠ The LoRA file") and "does not exist" in lines[-1]
    assert list(tools_tab._run(ctx, "merge", tools_tab.merge_args("", "", "", "same"))) == [
        "⚠ Fill in every field (at least one LoRA)."]
