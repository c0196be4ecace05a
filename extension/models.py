"""Base-model choices for the picker: checkpoint files, diffusers folders, hub ids already downloaded."""
from __future__ import annotations

import os
from pathlib import Path

SOURCES = ("Checkpoint file", "Diffusers folder", "Hub id")
CHECKPOINT_SUFFIXES = (".safetensors", ".ckpt")
MAX_DEPTH = 3  # model folders nest (A1111: models/Stable-diffusion/sub/x.safetensors) but not deeply


def _walk(folder: Path, depth: int = 0):
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith("."):
            continue
        yield entry
        if entry.is_dir() and depth < MAX_DEPTH and not (entry / "model_index.json").exists():
            yield from _walk(entry, depth + 1)


def hub_cache() -> Path:
    home = Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser()
    return Path(os.environ.get("HF_HUB_CACHE", home / "hub")).expanduser()


def find_models(source: str, folders: list[Path]) -> list[str]:
    """Candidates of one source kind: files or folders under `folders`, or cached hub ids."""
    if source == "Hub id":
        cache = hub_cache()
        names = [p.name[len("models--"):].replace("--", "/") for p in cache.glob("models--*")] if cache.is_dir() else []
        return sorted(names)
    found = []
    for folder in folders:
        for entry in _walk(Path(folder)):
            if source == "Checkpoint file" and entry.is_file() and entry.suffix in CHECKPOINT_SUFFIXES:
                found.append(str(entry))
            elif source == "Diffusers folder" and entry.is_dir() and (entry / "model_index.json").exists():
                found.append(str(entry))
    return found


def guess_source(path: str) -> str:
    if path.endswith(CHECKPOINT_SUFFIXES):
        return "Checkpoint file"
    if path and (Path(path).expanduser().is_dir() or path.startswith((".", "/", "~"))):
        return "Diffusers folder"
    return "Hub id" if path.count("/") == 1 else "Diffusers folder"


def found_info(found: list[str], folders: list[Path], source: str = SOURCES[0]) -> str:
    """The picker's hint; when it found nothing, how to make it find something."""
    if found:
        return f"{len(found)} found in {', '.join(map(str, folders)) or 'the hub cache'}."
    if source == "Hub id":
        return "No model in the local Hugging Face cache yet; type a hub id or a path below."
    if not folders:
        return ("No model folders given: start the UI with --model-dir FOLDER (repeatable; inside a WebUI its "
                "models/Stable-diffusion is used), or type the path below.")
    return (f"Nothing of this kind in {', '.join(map(str, folders))}; add folders with --model-dir FOLDER, choose "
            "another source, or type the path below.")
