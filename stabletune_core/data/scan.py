"""Walk a dataset folder once: find images, read captions, check every file.

The scan is the only place that looks at the folder. It decodes each image
fully (to catch truncated downloads before any GPU time is spent), reports
what it could not use with a reason, and never deletes, moves or rewrites a
user's file.
"""

from __future__ import annotations

import errno
import itertools
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..atomic import write_text_atomic
from ..config import ConfigError
from .buckets import assign_bucket
from .images import IMAGE_EXTENSIONS, UnreadableImageError, load_image
from .filenames import is_file
from .masks import MASK_FOLDER, is_mask_file, mask_beside, mask_problem

# Kohya's convention: a folder named "10_mychar" repeats its images 10 times
# per epoch, so small concepts can be balanced against large ones.
_REPEAT_FOLDER = re.compile(r"^(\d+)_(.+)$")
# More repeats than this is a folder name that was not meant as a repeat count (a date, an id).
MAX_REPEATS = 1000
_DATE = re.compile(r"^(19|20)\d\d(0[1-9]|1[0-2])(0[1-9]|[12]\d|3[01])$")

# Folders that tools create next to real data; scanning them would train on
# duplicates (.ipynb_checkpoints) or on macOS resource forks (__MACOSX).
_IGNORED_FOLDERS = {"__MACOSX"}


class DatasetError(ValueError):
    """The dataset folder cannot be used at all; the message says what to do."""


class RepeatFolderError(DatasetError, ConfigError):
    """A kohya `N_name` folder name that cannot be meant as a repeat count: bad input, one sentence."""

    def __init__(self, sentence: str) -> None:
        ConfigError.__init__(self, [sentence])


@dataclass(frozen=True)
class DataItem:
    """One usable training image. `width`/`height` are after EXIF rotation."""

    path: Path
    caption: str
    repeats: int
    width: int
    height: int
    is_reg: bool = False  # a regularisation (class) image: its loss is weighted by prior_loss_weight


@dataclass(frozen=True)
class SkippedFile:
    """An image-looking file the scan could not use, and why (one sentence)."""

    path: Path
    reason: str


@dataclass
class DatasetScan:
    root: Path
    items: list[DataItem] = field(default_factory=list)
    skipped: list[SkippedFile] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the folder names made the scan do (0_ folders)
    # kohya's ss_reg_dataset_dirs, {folder: {"n_repeats", "img_count"}}, as the folders were before balancing
    reg_dirs: dict[str, dict[str, int]] = field(default_factory=dict)

    def reg_dataset_dirs(self) -> dict[str, dict[str, int]]:
        """kohya's `ss_reg_dataset_dirs`: {folder name: {"n_repeats", "img_count"}} of the reg folders, as
        sd-scripts records them: the folder name's repeat count and every image in it, whatever balancing did."""
        return dict(self.reg_dirs)

    @property
    def total_with_repeats(self) -> int:
        """Images seen per epoch: each image counts `repeats` times."""
        return sum(item.repeats for item in self.items)

    def bucket_counts(self, buckets: list[tuple[int, int]]) -> dict[tuple[int, int], int]:
        """Images per bucket, counting repeats (what the batches are made of).

        Only buckets that receive at least one image appear, sorted by bucket.
        """
        counts: dict[tuple[int, int], int] = {}
        for item in self.items:
            bucket = assign_bucket(item.width, item.height, buckets)
            counts[bucket] = counts.get(bucket, 0) + item.repeats
        return dict(sorted(counts.items()))

    def tag_frequency(self) -> dict[str, dict[str, int]]:
        """{top-level folder: {tag: images carrying it}}, kohya's `ss_tag_frequency`.

        A1111 and Civitai show this from the LoRA metadata. Images directly in
        root are listed under the root folder's name; repeats are not counted.
        """
        frequency: dict[str, dict[str, int]] = {}
        for item in self.items:
            if item.is_reg:  # class images live outside root and are not what the LoRA is about
                continue
            relative = item.path.relative_to(self.root)
            folder = relative.parts[0] if len(relative.parts) > 1 else self.root.name
            tags = frequency.setdefault(folder, {})
            for tag in {t.strip() for t in item.caption.split(",") if t.strip()}:
                tags[tag] = tags.get(tag, 0) + 1
        return frequency


def scan_dataset(root: Path, default_caption: str = "", caption_extension: str = ".txt", *,
                 masked_loss: bool = False, folder_words: str = "Dataset folder") -> DatasetScan:
    """Find every usable image under `root`, in sorted, deterministic order.

    Images directly in `root` get repeats 1. A subfolder named `N_name` (1 <= N <= 1000)
    gives repeats N to every image inside it, including nested folders; other
    subfolders are scanned recursively with repeats 1. A `0_name` folder is left
    out (kohya does the same) and `notes` says so; N above 1000 is refused.
    Non-image files are ignored silently; images that fail to decode go to `skipped`, and with `masked_loss`
    so do images whose mask cannot be read or keeps nothing (masks.mask_problem). `folder_words` names the folder
    in the sentences of a DatasetError ("Class-image folder (reg_data_dir)" for the class images).
    """
    root = Path(root).expanduser()
    if not root.exists():
        raise DatasetError(f"Dataset folder {root} does not exist: choose the folder that holds your images.")
    if not root.is_dir():
        raise DatasetError(f"Dataset path {root} is a file, not a folder: choose the folder that holds your images.")
    caption_extension = _normalise_extension(caption_extension)

    scan = DatasetScan(root=root)
    candidates = list(_find_images(root, scan.notes))
    # Decoding is mostly C code that releases the GIL, so threads give a real
    # speed-up on large folders; map() keeps the sorted order.
    workers = min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = pool.map(lambda c: _check(c[0], c[1], default_caption, caption_extension, masked_loss), candidates)
        for result in results:
            (scan.items if isinstance(result, DataItem) else scan.skipped).append(result)

    if not scan.items and scan.notes and not scan.skipped:
        zero = sorted(p.name for p in root.iterdir() if p.is_dir() and folder_repeats(p.name) == 0)
        raise RepeatFolderError(f"{folder_words} {root} has nothing to train: its images are in 0_ folders "
                                f"({', '.join(zero)}), which 0 repeats leave out as in kohya's trainer; rename "
                                f"{zero[0]} to 1_{zero[0][2:]}.")
    if not scan.items:
        raise DatasetError(_no_images_sentence(root, scan.skipped, folder_words))
    return scan


def write_caption(image_path: Path, caption: str, caption_extension: str = ".txt") -> Path:
    """Write `caption` next to `image_path` atomically and return the caption path.

    The text goes to a temporary file in the same folder and is renamed over
    the old caption, so a crash never leaves a half-written caption. The image
    itself is never opened.
    """
    caption_path = Path(image_path).with_suffix(_normalise_extension(caption_extension))
    write_text_atomic(caption_path, caption.strip() + "\n")
    return caption_path


def _normalise_extension(extension: str) -> str:
    return extension if extension.startswith(".") else f".{extension}"


def folder_repeats(name: str) -> int | None:
    """The kohya repeat count a top-level folder name asks for (None: not an `N_name` folder).

    Refuses counts above MAX_REPEATS in one sentence: such a name is a date or an id, and taking it literally
    would make one epoch of millions of images.
    """
    match = _REPEAT_FOLDER.match(name)
    if not match:
        return None
    digits, rest = match.groups()
    repeats = int(digits)
    if repeats <= MAX_REPEATS:
        return repeats
    if _DATE.match(digits):
        raise RepeatFolderError(f"Folder {name} reads as {repeats:,} repeats (kohya's N_name folders repeat "
                                f"their images N times), but {digits} looks like a date; rename it to e.g. "
                                f"{rest}_{digits} (or 1_{name} to repeat it once).")
    raise RepeatFolderError(f"Folder {name} asks for {repeats:,} repeats per epoch, more than the {MAX_REPEATS} "
                            f"allowed; rename it with a smaller count such as 10_{rest}.")


def _find_images(root: Path, notes: list[str] | None = None) -> Iterator[tuple[Path, int]]:
    """Yield (path, repeats) for every image-extension file, sorted, depth first.

    A top-level `0_name` folder is left out, as kohya's trainer does; `notes` gets one sentence saying so.
    """

    def walk(folder: Path, repeats: int, seen: set[Path]) -> Iterator[tuple[Path, int]]:
        real = folder.resolve()
        if real in seen:  # a symlink loop; follow each real folder once
            return
        seen = seen | {real}
        try:
            entries = sorted(folder.iterdir(), key=lambda p: p.name)
        except OSError:
            return
        for entry in entries:
            if entry.name.startswith(".") or entry.name in _IGNORED_FOLDERS:
                continue
            if is_mask_file(entry) or (entry.name == MASK_FOLDER and entry.is_dir()):
                continue  # loss masks (masks.py), not training images
            if entry.is_dir():
                # Only a folder directly in root sets repeats (like kohya);
                # everything below it inherits them.
                asked = folder_repeats(entry.name) if folder == root else None
                if asked == 0:
                    count = sum(1 for _ in walk(entry, 0, seen))
                    if notes is not None:
                        notes.append(f"Folder {entry.name} asks for 0 repeats, so its {count} image(s) are left out "
                                     f"(as in kohya's trainer); rename it to 1_{entry.name[2:]} to train them.")
                    continue
                yield from walk(entry, asked or repeats, seen)
            elif entry.suffix.lower() in IMAGE_EXTENSIONS:
                yield entry, repeats

    yield from walk(root, 1, set())


def _check(path: Path, repeats: int, default_caption: str, caption_extension: str,
           masked_loss: bool = False) -> DataItem | SkippedFile:
    if path.is_symlink():
        try:
            path.resolve(strict=True)
        except RuntimeError:  # Python < 3.13 reports a loop as RuntimeError, later ones as OSError(ELOOP)
            return SkippedFile(path, "it is a symbolic link that loops back on itself; replace it with the image")
        except OSError as exc:
            what = "loops back on itself" if exc.errno == errno.ELOOP else "points to a file that does not exist"
            return SkippedFile(path, f"it is a symbolic link that {what}; replace it with the image")
    try:
        with load_image(path) as image:
            width, height = image.size
    except UnreadableImageError as exc:
        return SkippedFile(path, str(exc))
    if masked_loss and (problem := mask_problem(path)):
        return SkippedFile(path, problem)
    try:
        caption = _read_caption(path.with_suffix(caption_extension), default_caption)
    except UnicodeDecodeError:
        return SkippedFile(
            path, f"Caption file {path.with_suffix(caption_extension)} is not UTF-8 text; re-save it as UTF-8."
        )
    except OSError as exc:
        return SkippedFile(path, f"Caption file {path.with_suffix(caption_extension)} cannot be read ({exc}).")
    return DataItem(path=path, caption=caption, repeats=repeats, width=width, height=height)


def _read_caption(caption_path: Path, default_caption: str) -> str:
    if not is_file(caption_path):  # a caption name past the length limit cannot exist
        return default_caption
    # utf-8-sig: Windows Notepad writes a byte-order mark that would otherwise
    # become part of the first tag.
    text = caption_path.read_text(encoding="utf-8-sig").strip()
    return text or default_caption


def _no_images_sentence(root: Path, skipped: list[SkippedFile], folder_words: str) -> str:
    extensions = " ".join(sorted(IMAGE_EXTENSIONS))
    if not skipped:
        others: dict[str, int] = {}
        for path in itertools.islice(root.rglob("*"), 10000):
            if path.suffix and not path.name.startswith("."):
                others[path.suffix.lower()] = others.get(path.suffix.lower(), 0) + 1
        found = ", ".join(f"{n} {suffix}" for suffix, n in sorted(others.items(), key=lambda kv: -kv[1])[:3])
        if ".gif" in others:
            hint = "GIF files are not trained on: convert them to PNG, or choose another folder."
        else:
            hint = "put your training images in it or choose another folder."
        has = f"; it has {found} files" if found else ""
        return f"{folder_words} {root} holds no images ({extensions}){has}: {hint}"
    first = skipped[0]  # one example, named by its file name: the folder is the sentence's one path
    if all(entry.reason.startswith("its mask ") for entry in skipped):
        return (f"{folder_words} {root} has nothing to train with masked_loss: the masks of all {len(skipped)} "
                f"images are all black or cannot be read (e.g. {mask_beside(first.path).name}); paint the parts to "
                "train white, or turn masked_loss off.")
    return (f"{folder_words} {root} holds no usable images: all {len(skipped)} were skipped (e.g. {first.path.name}: "
            f"{brief_reason(first)}); replace them with readable PNG or JPEG files.")


def brief_reason(entry: SkippedFile) -> str:
    """Why a file was skipped in a few words, without its path (the sentence names the folder once): the reason's
    first clause, less the decoder's own details in brackets (they repeat the path)."""
    reason = entry.reason
    if reason.startswith("Cannot read image ") and ": " in reason:
        reason = reason.split(": ", 1)[1]
    reason = re.sub(r"\s*\(.*\)", "", reason.split(";")[0]).rstrip(". ")
    reason = reason.replace(str(entry.path), entry.path.name)
    return reason if len(reason) <= 80 else reason[:77] + "..."
