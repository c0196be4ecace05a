"""The Dataset tab's data: the engine's scan and tools (in their own process: they import torch), thumbnails,
captions and the caption editor's bulk changes (text only, here)."""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from PIL import Image, ImageOps

from stabletune_core.launch import ask_engine, engine_env
from stabletune_core.runs.jsonfiles import write_text_atomic
from stabletune_core.tools import captions

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


# ------------------------------------------------------------------------------- engine tools, in a subprocess
PROGRESS_MARK = "|"  # tqdm's bar: a line with it is progress, not a result


def tool_command(engine_python: str, command: str, *args: str) -> list[str]:
    """The argv (never a shell string) of `python -m stabletune_core COMMAND ARGS...` in the engine's Python."""
    return [engine_python, "-m", "stabletune_core", command, *args]


def run_tool(argv: list[str], timeout: float = 24 * 3600) -> Iterator[tuple[str, str | None]]:
    """Run an engine tool; yield (progress line, None) while it works (tqdm's last line: count, rate, ETA), then
    once ("", result): its summary on success, or '⚠ ' and its one-sentence error."""
    try:
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=engine_env(),
                                   stdin=subprocess.DEVNULL)
    except OSError as exc:
        yield "", f"⚠ The engine ({argv[0]}) could not start: {exc}."
        return
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.append(process.stdout.read()), daemon=True)
    reader.start()
    err, last, started = b"", "", time.monotonic()
    while True:
        chunk = process.stderr.read1(4096) if hasattr(process.stderr, "read1") else process.stderr.read(4096)
        if not chunk:
            break
        err += chunk
        lines = [line.strip() for line in re.split(r"[\r\n]", chunk.decode(errors="replace")) if line.strip()]
        progress = [line for line in lines if PROGRESS_MARK in line]
        if progress and progress[-1] != last:
            last = progress[-1]
            yield last, None
        if time.monotonic() - started > timeout:
            process.kill()
            break
    process.wait()
    reader.join(timeout=10)
    stdout = b"".join(out).decode(errors="replace").strip()
    if process.returncode == 0:
        yield "", stdout or "Done."
        return
    errors = [line for line in re.split(r"[\r\n]", err.decode(errors="replace"))
              if line.startswith("error: ") or line.startswith("internal error")]
    reason = errors[-1].removeprefix("error: ") if errors else (err.decode(errors="replace").strip().splitlines()
                                                                 or ["no output"])[-1]
    yield "", f"⚠ {reason}"


def caption_args(folder: str, model: str, *, prefix: str = "", threshold: float = 0.35,
                 character_threshold: float = 0.85, exclude: str = "", keep: str = "", existing: str = "keep",
                 keep_underscores: bool = False, caption_extension: str = ".txt") -> list[str]:
    args = [folder.strip(), "--model", model.strip(), "--prefix", prefix, "--threshold", str(threshold),
            "--character_threshold", str(character_threshold), "--exclude_tags", exclude, "--keep_tags", keep,
            "--caption_extension", caption_extension or ".txt"]
    if existing == "overwrite":
        args.append("--overwrite")
    elif existing == "append":
        args.append("--append")
    if keep_underscores:
        args.append("--keep_underscores")
    return args


def doctor(folder: str, engine_python: str, options: dict[str, Any], run_dir: str = "") -> dict[str, Any]:
    """The doctor's JSON report of `folder` (with crop previews in a temporary folder), or {"error"}."""
    if not folder or not folder.strip():
        return {"error": "Choose the folder that holds your training images."}
    work = Path(tempfile.mkdtemp(prefix="stabletune-doctor-"))
    args = [folder.strip(), "--json", str(work / "report.json"), "--previews", str(work / "previews")]
    if options.get("resolution"):
        args += ["--resolution", str(int(options["resolution"]))]
    if options.get("enable_bucket") is False:
        args.append("--no_buckets")
    if options.get("caption_extension"):
        args += ["--caption_extension", options["caption_extension"]]
    if options.get("pretrained_model_name_or_path"):
        args += ["--model", options["pretrained_model_name_or_path"]]
    if options.get("max_sequence_length"):  # FLUX.2 Klein: captions are counted against the run's text length
        args += ["--max_sequence_length", str(int(options["max_sequence_length"]))]
    if run_dir:
        args += ["--run", run_dir]
    result = None
    for _, result in run_tool(tool_command(engine_python, "doctor", *args), timeout=3600):
        pass
    if result and result.startswith("⚠"):
        return {"error": result[2:]}
    try:
        return json.loads((work / "report.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {"error": f"The doctor wrote no report ({result})."}


def doctor_text(report: dict[str, Any]) -> str:
    if "error" in report:
        return f"⚠ {report['error']}"
    lines = [f"**{report['images']} images checked.**"]
    lines += [f"- ⚠ {p}" for p in report["problems"]] or ["- No problems found."]
    return "\n".join(lines)


def doctor_tables(report: dict[str, Any]) -> tuple[list[list[Any]], list[list[Any]]]:
    """(one row per image: file, size, bucket, share kept, tokens, caption state; loss ranking rows)."""
    rows = [[item["path"], f"{item['width']}x{item['height']}", f"{item['bucket'][0]}x{item['bucket'][1]}",
             f"{item['kept']:.0%}", item.get("tokens", ""), item.get("caption", "")] for item in report.get("items", [])]
    ranking = (report.get("loss_ranking") or {}).get("images", [])
    losses = [[i["path"], round(i["score"], 2), i["samples"], "cannot fit" if i["flagged"] else ""] for i in ranking]
    return rows, losses


def doctor_previews(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The crops the model will see, with their bucket, the most cropped first."""
    items = sorted((i for i in report.get("items", []) if i.get("preview")), key=lambda i: i["kept"])
    return [(i["preview"], f"{Path(i['path']).name} · {i['bucket'][0]}x{i['bucket'][1]} · {i['kept']:.0%} kept")
            for i in items[:MAX_GALLERY]]


# ------------------------------------------------------------------------------------------ caption editor
def caption_files(items: list[dict[str, Any]], caption_extension: str) -> list[Path]:
    return [captions.caption_path(item["path"], caption_extension or ".txt") for item in items]


def filter_items(items: list[dict[str, Any]], query: str) -> list[int]:
    """Indexes of the items whose caption contains `query` (all of them for an empty query)."""
    query = (query or "").strip().lower()
    return [i for i, item in enumerate(items) if not query or query in (item.get("caption") or "").lower()]


def frequency_rows(items: list[dict[str, Any]], caption_extension: str) -> list[list[Any]]:
    files = caption_files(items, caption_extension)
    return [[tag, n] for tag, n in captions.tag_frequency(captions.read_caption(f) for f in files)]


def bulk_change(folder: str, items: list[dict[str, Any]], caption_extension: str, action: str, first: str,
                second: str = "") -> str:
    """Run one bulk change of the editor; returns the sentence the tab shows."""
    if not items:
        return "Scan a folder first."
    files = caption_files(items, caption_extension)
    try:
        if action == "replace":
            what, n = captions.bulk_edit(folder, files, replace=(first, second))
        elif action in ("add first", "add last"):
            what, n = captions.bulk_edit(folder, files, add_tag=first, position=action.split()[1])
        elif action == "remove":
            what, n = captions.bulk_edit(folder, files, remove_tag=first)
        else:
            what, n = captions.undo_last(folder)
            return f"Undid '{what}': {n} caption(s) restored."
    except (captions.CaptionEditError, OSError) as exc:
        return f"⚠ {exc}"
    return f"{what}: {n} caption(s) changed." + (" **Undo last bulk change** puts them back." if n else "")


def refreshed(items: list[dict[str, Any]], caption_extension: str) -> list[dict[str, Any]]:
    """The items with their captions read again from disk (after a bulk change)."""
    files = caption_files(items, caption_extension)
    return [dict(item, caption=captions.read_caption(f) or "") for item, f in zip(items, files)]
