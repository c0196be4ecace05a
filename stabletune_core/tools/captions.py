"""`python -m stabletune_core captions DIR ...`: the caption editor's bulk changes, and their undo.

Search and replace, add a tag to every caption or remove it, the tag frequency table, and undo of the last
bulk change. The Dataset tab calls the same functions in the UI process: this module is text only (no torch,
no gradio, nothing from `data/`, whose package imports torch). Every caption is written atomically, and a
bulk change first writes its journal (each file's text before and after) under the StableTune cache, so the
last one can be undone; an undo refuses, naming the file, when a caption was edited again since.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ..atomic import write_bytes_atomic, write_text_atomic
from ..cache import cache_root


class CaptionEditError(ValueError):
    """A bulk change or undo that cannot be done as asked; the message is one sentence. (Not ConfigError:
    stabletune_core.config needs pydantic 2, which a WebUI host's UI process may lack.)"""


def add_parser(commands: Any) -> None:
    p = commands.add_parser("captions", help="Edit the captions of a dataset in bulk (replace, add or remove a "
                            "tag, undo the last change) or print its tag frequency table.")
    p.add_argument("folder", help="The dataset folder.")
    p.add_argument("--caption_extension", "--caption-extension", default=".txt")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--replace", nargs=2, metavar=("OLD", "NEW"), help="Replace OLD by NEW in every caption.")
    what.add_argument("--add_tag", metavar="TAG", help="Add TAG to every caption that lacks it (images without a "
                      "caption get one).")
    what.add_argument("--remove_tag", metavar="TAG", help="Remove TAG from every caption.")
    what.add_argument("--undo", action="store_true", help="Undo the last bulk change made to this folder.")
    p.add_argument("--regex", action="store_true", help="--replace OLD is a Python regular expression.")
    p.add_argument("--position", choices=("first", "last"), default="first", help="Where --add_tag goes.")
    p.add_argument("--top", type=int, default=40, help="Rows of the tag frequency table.")
    p.set_defaults(run_tool=run)


# --------------------------------------------------------------------------------------- reading
def caption_path(image: Path | str, caption_extension: str = ".txt") -> Path:
    extension = caption_extension if caption_extension.startswith(".") else f".{caption_extension}"
    return Path(image).with_suffix(extension)


def read_caption(path: Path) -> str | None:
    """The caption's text (None: no caption file). utf-8-sig: Notepad's byte-order mark is not a tag."""
    try:
        return path.read_text(encoding="utf-8-sig").strip()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        raise CaptionEditError(f"{path} is not UTF-8 text; re-save it as UTF-8 before editing captions.") from None


def split_tags(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def tag_frequency(texts: Iterable[str | None]) -> list[tuple[str, int]]:
    """(tag, captions carrying it), most frequent first, then by name."""
    counts: dict[str, int] = {}
    for text in texts:
        for tag in set(split_tags(text)):
            counts[tag] = counts.get(tag, 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


# --------------------------------------------------------------------------------------- changes
def replaced(text: str | None, old: str, new: str, regex: bool = False) -> str | None:
    if text is None or not old:
        return text
    return re.sub(old, new, text) if regex else text.replace(old, new)


def with_tag(text: str | None, tag: str, position: str = "first") -> str:
    tags = split_tags(text)
    if tag in tags:
        return text or ""
    return ", ".join([tag] + tags if position == "first" else tags + [tag])


def without_tag(text: str | None, tag: str) -> str | None:
    if text is None:
        return None
    tags = split_tags(text)
    return ", ".join(t for t in tags if t != tag) if tag in tags else text


BOM = b"\xef\xbb\xbf"


def read_bytes(path: Path) -> bytes | None:
    """The caption file as stored (None: there is none): what an undo puts back, byte for byte."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def encoded_like(text: str, old: bytes | None) -> bytes:
    """`text` as the caption file `old` was stored: its byte-order mark, its line ending (CRLF or LF) and a final
    newline only if it had one; a new caption file is UTF-8 ending in one newline."""
    if old is None:
        return (text + "\n").encode("utf-8")
    newline = "\r\n" if b"\r\n" in old else "\n"
    ending = newline if old.endswith(b"\n") else ""
    body = (text.replace("\n", newline) + ending).encode("utf-8")
    return (BOM + body) if old.startswith(BOM) else body


@dataclass(frozen=True)
class Change:
    path: Path
    before: str | None  # None: the caption file did not exist
    after: str
    before_bytes: bytes | None  # the file exactly as it was (None: it did not exist)

    @property
    def after_bytes(self) -> bytes:
        return encoded_like(self.after, self.before_bytes)


def plan_changes(captions: Iterable[Path], edit) -> list[Change]:
    """The captions `edit` (text or None -> new text or None) would change."""
    changes = []
    for path in captions:
        before = read_caption(path)
        after = edit(before)
        if after is not None and after.strip() != (before or "") and not (before is None and not after.strip()):
            changes.append(Change(path, before, after.strip(), read_bytes(path)))
    return changes


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def journal_path(folder: Path | str) -> Path:
    """Where a folder's last bulk change is recorded (the cache, not the user's dataset)."""
    key = hashlib.sha1(str(Path(folder).expanduser().resolve()).encode()).hexdigest()[:16]
    return cache_root() / "caption-undo" / f"{key}.json"


def apply_changes(folder: Path | str, changes: list[Change], what: str) -> int:
    """Write the journal, then every changed caption (each atomically); returns how many were written. A change
    that fails half-way puts back the captions it already wrote, so the folder is as before or as asked."""
    if not changes:
        return 0
    journal = journal_path(folder)
    journal.parent.mkdir(parents=True, exist_ok=True)
    record = {"folder": str(Path(folder).expanduser().resolve()), "what": what, "time": time.time(),
              "files": [{"path": str(c.path), "before": c.before, "after": c.after,
                         "before_bytes": _b64(c.before_bytes), "after_bytes": _b64(c.after_bytes)} for c in changes]}
    write_text_atomic(journal, json.dumps(record, ensure_ascii=False, indent=1))
    for n, change in enumerate(changes):
        try:
            write_bytes_atomic(change.path, change.after_bytes)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            if not _roll_back(changes[:n]):
                raise CaptionEditError(f"Could not write {change.path} ({reason}); {n} of {len(changes)} captions "
                                       "were changed and could not all be put back, so run undo to restore "
                                       "them.") from None
            write_text_atomic(journal, json.dumps({**record, "undone": time.time()}, ensure_ascii=False))
            raise CaptionEditError(f"Could not write {change.path} ({reason}), so no caption was changed (the "
                                   f"{n} written before it were put back); fix that and run the change again."
                                   ) from None
    return len(changes)


def _roll_back(written: list[Change]) -> bool:
    """Put the captions a failed bulk change wrote back as they were; False when one of them cannot be."""
    ok = True
    for change in reversed(written):
        try:
            _restore(change.path, change.before_bytes)
        except OSError:
            ok = False
    return ok


def _restore(path: Path, before: bytes | None) -> None:
    if before is None:
        path.unlink(missing_ok=True)  # the bulk change created it
    else:
        write_bytes_atomic(path, before)


def last_change(folder: Path | str) -> dict[str, Any] | None:
    """The journal of the folder's last bulk change, None when there is nothing to undo."""
    try:
        record = json.loads(journal_path(folder).read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return None if record.get("undone") else record


def undo_last(folder: Path | str) -> tuple[str, int]:
    """Put back every caption of the last bulk change: (what was undone, files restored). Refuses when a caption
    was changed since (it names the file), so an undo never throws away a later edit."""
    record = last_change(folder)
    if record is None:
        raise CaptionEditError(f"There is no bulk caption change to undo in {folder}.")
    files = record["files"]
    to_restore = []
    for entry in files:
        path = Path(entry["path"])
        if "after_bytes" not in entry:  # a journal of an older StableTune: the text, not the bytes
            before = None if entry["before"] is None else (entry["before"] + "\n").encode("utf-8")
            if read_caption(path) == entry["after"]:
                to_restore.append((path, before))
            elif read_caption(path) != entry["before"]:
                raise _changed_since(entry, record)
            continue
        now, before = read_bytes(path), _unb64(entry["before_bytes"])
        if now == _unb64(entry["after_bytes"]):
            to_restore.append((path, before))
        elif now != before:  # as before already: a change that stopped before this file
            raise _changed_since(entry, record)
    restored = 0
    for path, before in to_restore:
        _restore(path, before)
        restored += 1
    write_text_atomic(journal_path(folder), json.dumps({**record, "undone": time.time()}, ensure_ascii=False))
    return record["what"], restored


def _changed_since(entry: dict[str, Any], record: dict[str, Any]) -> CaptionEditError:
    return CaptionEditError(f"{entry['path']} was changed after the bulk change '{record['what']}', so undo stops "
                            "here to keep that edit; nothing was undone.")


def bulk_edit(folder: Path | str, captions: list[Path], *, replace: tuple[str, str] | None = None,
              regex: bool = False, add_tag: str | None = None, remove_tag: str | None = None,
              position: str = "first") -> tuple[str, int]:
    """One bulk change over `captions` (the caption paths of the dataset's images): (description, written)."""
    if replace:
        old, new = replace
        if not old:
            raise CaptionEditError("Give the text to find; an empty search would change nothing.")
        if regex:
            try:
                re.compile(old)
            except re.error as exc:
                raise CaptionEditError(f"'{old}' is not a regular expression ({exc}).") from None
        edit, what = (lambda t: replaced(t, old, new, regex)), f"replace '{old}' with '{new}'"
    elif add_tag is not None:
        tag = add_tag.strip().strip(",").strip()
        if not tag or "," in tag:
            raise CaptionEditError(f"'{add_tag}' is not one tag; give a tag without commas.")
        edit, what = (lambda t: with_tag(t, tag, position)), f"add '{tag}' ({position})"
    elif remove_tag is not None:
        tag = remove_tag.strip()
        if not tag:
            raise CaptionEditError("Give the tag to remove.")
        edit, what = (lambda t: without_tag(t, tag)), f"remove '{tag}'"
    else:
        raise CaptionEditError("Choose a bulk change: replace, add a tag or remove a tag.")
    return what, apply_changes(folder, plan_changes(captions, edit), what)


def frequency_table(rows: list[tuple[str, int]], total: int, top: int) -> str:
    if not rows:
        return "No tags: the captions are empty."
    width = max(len(tag) for tag, _ in rows[:top])
    lines = [f"{'tag':<{width}}  images"]
    lines += [f"{tag:<{width}}  {n:>4} ({n / max(total, 1):.0%})" for tag, n in rows[:top]]
    if len(rows) > top:
        lines.append(f"... and {len(rows) - top} more tags")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from ..config import ConfigError

    try:
        return _run(args)
    except CaptionEditError as exc:
        raise ConfigError([str(exc)]) from None


def _run(args: argparse.Namespace) -> int:
    from ..data import DatasetError, scan_dataset

    folder = Path(args.folder).expanduser()
    if args.top < 1:
        raise CaptionEditError(f"--top {args.top} is not a number of rows; give a whole number of 1 or more.")
    if args.undo:
        what, n = undo_last(folder)
        print(f"Undid '{what}': {n} caption(s) restored.")
        return 0
    try:
        scan = scan_dataset(folder, caption_extension=args.caption_extension)
    except DatasetError as exc:
        raise CaptionEditError(str(exc)) from None
    captions = [caption_path(item.path, args.caption_extension) for item in scan.items if not item.is_reg]
    if args.replace or args.add_tag is not None or args.remove_tag is not None:
        what, n = bulk_edit(folder, captions, replace=tuple(args.replace) if args.replace else None,
                            regex=args.regex, add_tag=args.add_tag, remove_tag=args.remove_tag,
                            position=args.position)
        print(f"{what}: {n} caption(s) changed" + ("; `--undo` puts them back." if n else "."))
        return 0
    print(frequency_table(tag_frequency(read_caption(c) for c in captions), len(captions), args.top))
    return 0
