"""Issue 37.15: a bulk caption change and its undo leave every caption file as it was, byte for byte (a UTF-8
byte-order mark, CRLF line endings, a missing final newline), and a change that fails half-way leaves the folder
as it was instead of promising an undo that then refuses."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from stabletune_core.cli import main
from stabletune_core.tools import captions as editor
from tests.tools_helpers import read_only

#: eight captions as users' tools write them: Notepad's BOM, Windows line endings, no final newline, empty
STORED = {
    "a": b"red hair, smile\n",
    "b": b"\xef\xbb\xbfsmile, red hair\n",
    "c": b"blue hair, outdoors\r\n",
    "d": b"\xef\xbb\xbfgreen hair, indoors\r\n",
    "e": b"no newline at the end",
    "f": b"two lines,\r\nsecond line\r\n",
    "g": b"  padded, caption  \n\n",
    "h": b"",
}


@pytest.fixture
def dataset(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("STABLETUNE_CACHE", str(tmp_path / "cache"))  # the undo journal lives there
    root = tmp_path / "data"
    (root / "1_late").mkdir(parents=True)
    for name, data in STORED.items():
        Image.new("RGB", (16, 16), (9, 9, 9)).save(root / f"{name}.png")
        (root / f"{name}.txt").write_bytes(data)
    Image.new("RGB", (16, 16), (9, 9, 9)).save(root / "1_late" / "z.png")  # no caption yet
    return root


def stored(root: Path) -> dict[str, bytes | None]:
    files = {name: root / f"{name}.txt" for name in STORED} | {"z": root / "1_late" / "z.txt"}
    return {name: path.read_bytes() if path.exists() else None for name, path in files.items()}


@pytest.mark.parametrize("change", [["--add_tag", "mychar"], ["--remove_tag", "smile"],
                                    ["--replace", "hair", "hat"]])
def test_undo_restores_every_caption_byte_for_byte(dataset, change, capsys):
    before = stored(dataset)
    assert main(["captions", str(dataset), *change]) == 0
    changed = stored(dataset)
    assert changed != before
    assert main(["captions", str(dataset), "--undo"]) == 0
    assert stored(dataset) == before


def test_a_bulk_change_keeps_each_files_own_format(dataset):
    assert main(["captions", str(dataset), "--add_tag", "mychar"]) == 0
    now = stored(dataset)
    assert now["b"] == b"\xef\xbb\xbfmychar, smile, red hair\n"  # the BOM stays
    assert now["c"] == b"mychar, blue hair, outdoors\r\n"  # and the CRLF
    assert now["e"] == b"mychar, no newline at the end"  # no final newline added
    assert now["f"] == b"mychar, two lines, second line\r\n"  # tags are re-joined; the ending stays
    assert now["z"] == b"mychar\n"  # a new caption file: UTF-8, one newline


def test_a_change_that_fails_half_way_leaves_the_folder_as_it_was(dataset, capsys):
    before = stored(dataset)
    with read_only(dataset / "1_late"):  # its caption is written last: the root's eight go first
        assert main(["captions", str(dataset), "--add_tag", "mychar"]) == 2
        err = capsys.readouterr().err.strip()
        assert stored(dataset) == before, "the captions written before the failure were not put back"
    assert err.startswith("error: Could not write") and "no caption was changed" in err
    assert err.count("\n") == 0 and "undo puts them back" not in err
    assert main(["captions", str(dataset), "--undo"]) == 2  # nothing left to undo, and it says so
    assert "no bulk caption change to undo" in capsys.readouterr().err
    assert main(["captions", str(dataset), "--add_tag", "mychar"]) == 0  # and the change works once possible


def test_undo_after_a_change_that_could_not_roll_back_puts_everything_back(dataset):
    """When even the roll-back fails, the promise "undo puts them back" holds: undo skips the captions the change
    never reached and restores the rest."""
    captions = [editor.caption_path(dataset / f"{n}.png") for n in STORED] + [dataset / "1_late" / "z.txt"]
    before = stored(dataset)
    changes = editor.plan_changes(captions, lambda t: editor.with_tag(t, "mychar"))
    editor.apply_changes(dataset, changes[:4], "add 'mychar' (first)")  # the first four written ...
    journal = editor.journal_path(dataset)

    record = json.loads(journal.read_text())  # ... while the journal lists all nine, as a stopped change leaves it
    record["files"] = [{"path": str(c.path), "before": c.before, "after": c.after,
                        "before_bytes": editor._b64(c.before_bytes), "after_bytes": editor._b64(c.after_bytes)}
                       for c in changes]
    journal.write_text(json.dumps(record))
    assert editor.undo_last(dataset) == ("add 'mychar' (first)", 4)
    assert stored(dataset) == before


def test_top_must_be_a_count(dataset, capsys):
    for bad in ("0", "-3"):
        assert main(["captions", str(dataset), "--top", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --top") and "\n" not in err
