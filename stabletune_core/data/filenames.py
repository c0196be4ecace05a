"""File names the engine derives from a user's file name (a mask or caption beside an image) may pass the file
system's limit on one name (255 bytes on ext4, NTFS, APFS: 83 Japanese characters in UTF-8 are 249 bytes). Such a
name cannot exist, so looking it up is "no such file", not an error that ends the run."""
from __future__ import annotations

import errno
import os
from pathlib import Path

NAME_MAX_BYTES = 255  # the usual limit; the folder's own limit is asked for when the system can say it


def name_limit(folder: Path) -> int:
    """The longest file name, in bytes, the file system of `folder` takes."""
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (OSError, ValueError, AttributeError):  # no such folder, or a system without pathconf
        return NAME_MAX_BYTES


def name_too_long(path: Path) -> bool:
    """Whether `path`'s last name is longer than its folder's file system allows (it can never exist)."""
    return len(os.fsencode(path.name)) > name_limit(path.parent)


def is_file(path: Path) -> bool:
    """`path.is_file()`, with a name too long to exist answered as "not a file" instead of OSError(ENAMETOOLONG)."""
    try:
        return path.is_file()
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            return False
        raise
