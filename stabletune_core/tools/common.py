"""What several tools share: the one-sentence refusal, write checks and the progress bar."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterable, Iterator, TypeVar

from ..config import ConfigError

T = TypeVar("T")


def refuse(sentence: str) -> ConfigError:
    """Bad input: one sentence for the user (the CLI prints `error: ...` and exits 2)."""
    return ConfigError([sentence])


def check_writable(folders: Iterable[Path], what: str) -> None:
    """Refuse before any model loads when a folder the tool must write into is read-only."""
    for folder in sorted({Path(f) for f in folders}):
        if not os.access(folder, os.W_OK | os.X_OK):
            raise refuse(f"Cannot write {what} in {folder}: the folder is read-only for this user; make it "
                         "writable (or copy the dataset somewhere you can write) and run again.")


def check_new_output(path: Path, flag: str = "--output") -> None:
    """A tool writes a new file or folder; an existing one is never replaced."""
    if path.exists():
        raise refuse(f"{path} already exists; choose another output path ({flag}): tools never overwrite a file.")
    if not path.parent.is_dir():
        raise refuse(f"The folder {path.parent} for {path.name} does not exist; create it or choose another "
                     f"output path ({flag}).")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise refuse(f"Cannot write {path.name} in {path.parent}: the folder is read-only for this user.")


def progress(items: Iterable[T], total: int, desc: str, unit: str = "img") -> Iterator[T]:
    """tqdm on stderr (the UI reads its last line as the progress and ETA)."""
    from tqdm import tqdm

    yield from tqdm(items, total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=False, ncols=90,
                    mininterval=0.5)
