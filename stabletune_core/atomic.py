"""Replace files and folders so that neither a reader nor a crash ever sees half of one.

Everything the engine replaces goes through `atomic_path`: the new content is written under a temporary
name in the same folder (a rename across file systems is a copy, not atomic), flushed to disk, renamed over
the target, and the folder's entry is flushed too, so after a power cut the target is the old version or
the new one, never a mix or an empty file. A writer that fails (or a crash) leaves the old target as it was
and no temporary file behind.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def fsync_file(path: Path | str) -> None:
    """Flush a written file's data to the disk."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path | str) -> None:
    """Flush a folder's entries (the names renamed into it) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            fsync_file(Path(folder) / name)
        fsync_dir(folder)


def replace(src: Path | str, dst: Path | str, *, durable: bool = True) -> None:
    """Rename `src` over `dst` (a file, or a folder over a missing or empty one) and, unless told otherwise, make
    the rename durable."""
    os.replace(src, dst)
    if durable:
        fsync_dir(Path(dst).parent)


def _umask() -> int:
    try:  # Linux says it without changing it (os.umask can only be read by setting it, racing other threads)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def user_permissions(path: Path | str) -> None:
    """Give a file (or folder) the permissions anything the user creates gets: temporary files are made
    private (0600 / 0700), and safetensors writes its files 0600."""
    full = 0o777 if Path(path).is_dir() else 0o666
    os.chmod(path, full & ~_umask())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


_TEMP_NAME_BYTES = 200  # of the target's name in a temporary's: with the dot, random part and .tmp under 255


def _short_name(name: str) -> str:
    """`name` cut to _TEMP_NAME_BYTES of UTF-8 on a character boundary, so that the temporary of a target named
    near the file system's 255-byte limit (83 Japanese characters) can still be made."""
    encoded = os.fsencode(name)
    if len(encoded) <= _TEMP_NAME_BYTES:
        return name
    return encoded[:_TEMP_NAME_BYTES].decode("utf-8", errors="ignore")


@contextmanager
def atomic_path(path: Path | str, *, folder: bool = False, durable: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write to (a file, or with `folder=True` an empty folder); when
    the block ends without an exception, it replaces `path`. On an exception the temporary is removed and
    `path` is untouched. A folder target must be missing or empty (the rename refuses a full one). The parent folder must exist:
    a run folder deleted under a live run is not silently made again.

    `durable=False` skips the fsync before the rename: readers still see the old file or the new one, never a
    half-written one, but a power cut may lose the new content. For a heartbeat rewritten every step (status.json
    while training), where an fsync costs more than the rest of the step's bookkeeping together."""
    path = Path(path)
    prefix, suffix = f".{_short_name(path.name)}.", ".tmp"
    if folder:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=path.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=path.parent)
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        if durable and folder:
            _fsync_tree(tmp)
        elif durable:
            fsync_file(tmp)
        user_permissions(tmp)
        replace(tmp, path, durable=durable)
    except BaseException:
        _remove(tmp)
        raise


def write_bytes_atomic(path: Path | str, data: bytes, *, durable: bool = True) -> None:
    """Replace `path` with `data` (see `atomic_path` for `durable`)."""
    with atomic_path(path, durable=durable) as tmp:
        tmp.write_bytes(data)


def write_text_atomic(path: Path | str, text: str, *, durable: bool = True) -> None:
    """Replace `path` with `text` (UTF-8, newlines written as given on every platform)."""
    write_bytes_atomic(path, text.encode("utf-8"), durable=durable)
