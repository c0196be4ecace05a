"""The Dataset tab's data: the engine's scan (in its own process, it imports torch), thumbnails, captions."""
from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Any

from PIL import Image, ImageOps

from stabletune_core.launch import ask_engine
from stabletune_core.runs.jsonfiles import write_text_atomic

THUMB_SIZE = 256
MAX_GALLERY = 300  # more thumbnails only slow the page; the counts cover the whole folder
THUMB_DIR = Path(tempfile.gettempdir()) / "stabletune-thumbs"


def scan(folder: str, engine_python: str, options: dict[str, Any]) -> dict[str, Any]:
    """The engine's scan of `folder`: items, skipped files with reasons, bucket counts (or {"error"})."""
    if not folder or not folder.strip():
        return {"error": "Choose the folder that holds your training images."}
    argv = ["scan", "--data", folder.strip(), "--caption-extension", options.get("caption_extension") or ".txt",
            "--default-caption", options.get("default_caption") or ""]
    for key in ("resolution", "bucket_step", "min_bucket_reso", "max_bucket_reso"):
        if options.get(key):
            argv += [f"--{key.replace('_', '-')}", str(int(options[key]))]
    argv.append("--enable-bucket" if options.get("enable_bucket", True) else "--no-enable-bucket")
    return ask_engine(argv, engine_python, timeout=900)


def thumbnail(path: str) -> str:
    """A small copy of the image in the temp folder, so the browser never loads (or is allowed to reach)
    the user's originals; cached by path, size and mtime."""
    source = Path(path)
    stat = source.stat()
    key = hashlib.sha1(f"{source.resolve()}|{stat.st_mtime_ns}|{stat.st_size}".encode()).hexdigest()
    target = THUMB_DIR / f"{key}.jpg"
    if not target.exists():
        THUMB_DIR.mkdir(parents=True, exist_ok=True)
        with Image.open(source) as image:
            image = ImageOps.exif_transpose(image).convert("RGB")
            image.thumbnail((THUMB_SIZE, THUMB_SIZE))
            image.save(target, quality=85)
    return str(target)


def gallery_items(items: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(thumbnail(item["path"]), item["caption"] or "(no caption)") for item in items[:MAX_GALLERY]]


def counts_text(result: dict[str, Any]) -> str:
    items, skipped = result.get("items", []), result.get("skipped", [])
    repeated = result.get("total_with_repeats", len(items))
    captioned = sum(1 for i in items if i.get("caption"))
    lines = [f"**{len(items)} usable images** ({repeated} per epoch with folder repeats) · "
             f"{captioned} with a caption · {len(items) - captioned} without · {len(skipped)} skipped"]
    if len(items) > MAX_GALLERY:
        lines.append(f"The gallery shows the first {MAX_GALLERY}; the counts cover the whole folder.")
    return "\n\n".join(lines)


def save_caption(image_path: str, caption: str, caption_extension: str = ".txt") -> Path:
    """Write the caption next to the image (atomically); the image file is never opened for writing."""
    extension = caption_extension if caption_extension.startswith(".") else f".{caption_extension}"
    target = Path(image_path).with_suffix(extension)
    write_text_atomic(target, caption.strip() + "\n")
    return target
