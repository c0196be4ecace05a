"""What a model's files say about its family, and the family facts the UI reads, with the standard library only.

The engine (models/flux2_klein/family.py, config/) and the UI (extension/, which never imports torch and, inside an
AUTOMATIC1111 with pydantic 1, cannot import stabletune_core.config either) tell a FLUX.2 Klein model by this one
rule: a diffusers folder whose model_index.json names a Flux2Klein pipeline, or a single file with FLUX.2's
modulation layer and without FLUX.2 dev's guidance input (ComfyUI's and diffusers' markers).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The family whose adapter files load in some host programs only by kind (config/hosts.py) and whose training
#: memory the UI estimates before Start (models/flux2_klein/memory.py).
KLEIN = "flux2_klein"
#: What a diffusers folder's model_index.json `_class_name` starts with for a FLUX.2 Klein model.
KLEIN_PIPELINE_PREFIX = "Flux2Klein"
#: FLUX.2's single-file markers (BFL keys, after an all-in-one file's prefix is taken off).
FLUX2_MODULATION_KEY = "double_stream_modulation_img.lin.weight"
FLUX2_DEV_GUIDANCE_KEY = "guidance_in.in_layer.weight"
ALL_IN_ONE_PREFIX = "model.diffusion_model."
#: A safetensors header larger than this is not a model's (the real 9B's is well under 1 MB).
MAX_HEADER_BYTES = 100 * 2 ** 20


def is_flux2_klein(family: str | None) -> bool:
    """The family is FLUX.2 Klein: its adapter files' host limits by kind apply (config/hosts.py) and the UI
    estimates its training memory before Start."""
    return family == KLEIN


def flux2_file_kind(keys: Any) -> str | None:
    """'klein' or 'flux2_dev' for the tensor names of a FLUX.2 single file, None for any other file."""
    bare = {k.removeprefix(ALL_IN_ONE_PREFIX) for k in keys}
    if FLUX2_MODULATION_KEY not in bare:
        return None
    return "flux2_dev" if FLUX2_DEV_GUIDANCE_KEY in bare else "klein"


def names_klein_pipeline(model_index: dict[str, Any]) -> bool:
    """A diffusers folder's model_index.json names a FLUX.2 Klein pipeline."""
    return str(model_index.get("_class_name", "")).startswith(KLEIN_PIPELINE_PREFIX)


def safetensors_keys(path: Path) -> set[str]:
    """The tensor names of a .safetensors file: an 8-byte little-endian length, then that much JSON."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size <= MAX_HEADER_BYTES:
            raise ValueError(f"{Path(path).name} has no safetensors header")
        header = json.loads(f.read(size))
    return {k for k in header if k != "__metadata__"}


def files_name_klein(source: str | Path) -> bool:
    """A FLUX.2 Klein diffusers folder or single (BFL-layout) transformer file; False for anything else or
    anything unreadable."""
    path = Path(str(source)).expanduser()
    try:
        if path.is_file() and path.suffix.lower() == ".safetensors":
            return flux2_file_kind(safetensors_keys(path)) == "klein"
        if path.is_dir():
            index = path / "model_index.json"
            return index.is_file() and names_klein_pipeline(json.loads(index.read_text()))
    except (OSError, ValueError, AttributeError):
        pass
    return False
