"""What a user pointed the base model at, told apart before any family loads it: a diffusers folder, a single
.safetensors file (its tensor names and shapes read from the header alone), a hub id, or something refused in one
sentence (a pickle, a missing path). Every family's load() starts here."""
from __future__ import annotations

from pathlib import Path

from ..config.world import PICKLE_SUFFIXES
from .base import ModelLoadError

SINGLE_FILE_SUFFIXES = {".safetensors"}


def check_source(source: str | Path, *, local_files_only: bool) -> tuple[str, Path | None]:
    """Classify what the user pointed at: ("folder"|"file"|"hub", path). Raises ModelLoadError with one sentence."""
    text = str(source).strip()
    if not text:
        raise ModelLoadError("No base model was given; point at a diffusers folder or a .safetensors checkpoint.")
    path = Path(text).expanduser()
    suffix = path.suffix.lower()
    if suffix in PICKLE_SUFFIXES:
        raise ModelLoadError(
            f"Refusing to open '{path.name}': {suffix} files are Python pickles that can run arbitrary code when "
            "loaded, so convert it to .safetensors with a tool you trust and point StableTune at that file."
        )
    if path.is_dir():
        if not (path / "model_index.json").is_file() and not (path / "unet").is_dir():
            raise ModelLoadError(
                f"The folder '{path}' is not a diffusers model (it has no model_index.json and no unet/ subfolder)."
            )
        return "folder", path
    if path.is_file():
        if suffix not in SINGLE_FILE_SUFFIXES:
            raise ModelLoadError(f"'{path.name}' is not a model StableTune can read; use a .safetensors file or a diffusers folder.")
        return "file", path
    looks_like_hub_id = text.count("/") == 1 and not text.startswith((".", "/", "~")) and suffix == ""
    if looks_like_hub_id and not local_files_only:
        return "hub", None
    hint = " (downloading from the Hugging Face hub is off)" if looks_like_hub_id else ""
    raise ModelLoadError(f"The base model '{text}' was not found: there is no such file or folder{hint}.")


def safetensors_header(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """(tensor name -> shape, the file's metadata) of a .safetensors file, without reading its tensors."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}, dict(f.metadata() or {})
