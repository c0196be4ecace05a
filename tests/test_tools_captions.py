"""The caption editor's engine (issue 26.2): bulk replace, add and remove a tag, the frequency table, undo of
the last bulk change, through the CLI and the functions the Dataset tab calls (text only: no torch)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from stabletune_core.cli import main
from stabletune_core.tools import captions as editor


@pytest.fixture
def dataset(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("STABLETUNE_CACHE", str(tmp_path / "cache"))  # the undo journal lives there
    root = tmp_path / "data"
    (root / "5_cat").mkdir(parents=True)
    for name in ("one", "two", "5_cat/three"):
        Image.new("RGB", (16, 16), (9, 9, 9)).save(root / f"{name}.png")
    (root / "one.txt").write_text("red hair, smile, outdoors\n")
    (root / "two.txt").write_text("\ufeffsmile, red hair\n")  # Notepad's byte-order mark
    return root


def texts(root: Path) -> dict[str, str | None]:
    return {name: editor.read_caption(root / f"{name}.txt") for name in ("one", "two", "5_cat/three")}


def test_bulk_changes_and_undo_through_the_cli(dataset, capsys):
    assert main(["captions", str(dataset)]) == 0
    table = capsys.readouterr().out
    assert "red hair" in table and "2 (67%)" in table and "outdoors" in table and "1 (33%)" in table

    assert main(["captions", str(dataset), "--add_tag", "mychar"]) == 0
    assert "3 caption(s) changed" in capsys.readouterr().out
    assert texts(dataset) == {"one": "mychar, red hair, smile, outdoors", "two": "mychar, smile, red hair",
                              "5_cat/three": "mychar"}  # the uncaptioned image gets one
    assert main(["captions", str(dataset), "--replace", "red hair", "blue hair"]) == 0
    assert texts(dataset)["two"] == "mychar, smile, blue hair"
    assert main(["captions", str(dataset), "--undo"]) == 0  # undoes the replace only
    assert "Undid 'replace 'red hair' with 'blue hair'': 2 caption(s) restored." in capsys.readouterr().out
    assert texts(dataset)["one"] == "mychar, red hair, smile, outdoors"
    assert main(["captions", str(dataset), "--undo"]) == 2
    assert "no bulk caption change to undo" in capsys.readouterr().err


def test_remove_tag_then_undo_removes_only_what_it_created(dataset):
    captions = [editor.caption_path(dataset / f"{n}.png") for n in ("one", "two", "5_cat/three")]
    what, n = editor.bulk_edit(dataset, captions, add_tag="mychar", position="last")
    assert (what, n) == ("add 'mychar' (last)", 3) and texts(dataset)["one"] == "red hair, smile, outdoors, mychar"
    assert editor.undo_last(dataset) == ("add 'mychar' (last)", 3)
    assert texts(dataset) == {"one": "red hair, smile, outdoors", "two": "smile, red hair", "5_cat/three": None}
    assert editor.bulk_edit(dataset, captions, remove_tag="smile") == ("remove 'smile'", 2)
    assert texts(dataset)["two"] == "red hair"
    assert editor.tag_frequency(texts(dataset).values()) == [("red hair", 2), ("outdoors", 1)]
    assert editor.bulk_edit(dataset, captions, replace=(r"(\w+) hair", r"\1 hat"), regex=True)[1] == 2
    assert texts(dataset)["one"] == "red hat, outdoors"


def test_undo_refuses_after_a_later_edit_and_bad_input_is_one_sentence(dataset, capsys):
    captions = [editor.caption_path(dataset / f"{n}.png") for n in ("one", "two", "5_cat/three")]
    editor.bulk_edit(dataset, captions, remove_tag="smile")
    (dataset / "two.txt").write_text("edited by hand\n")
    with pytest.raises(editor.CaptionEditError, match=r"two\.txt was changed after the bulk change"):
        editor.undo_last(dataset)
    assert texts(dataset)["one"] == "red hair, outdoors"  # nothing was undone
    assert main(["captions", str(dataset), "--add_tag", "a, b"]) == 2
    assert capsys.readouterr().err.strip() == "error: 'a, b' is not one tag; give a tag without commas."
    assert main(["captions", str(dataset), "--replace", "(", "x", "--regex"]) == 2
    assert "is not a regular expression" in capsys.readouterr().err
    assert main(["captions", str(dataset / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_editor_module_loads_without_torch_or_pydantic():
    """The Dataset tab calls it in the UI process, which never imports torch (and in A1111 has pydantic 1)."""
    code = ("import sys; import stabletune_core.tools.captions; "
            "bad = [m for m in ('torch', 'pydantic', 'gradio') if m in sys.modules]; assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
