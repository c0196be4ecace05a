"""What a model's files say about its family, and the family facts the UI reads, with the standard library only.

The engine (models/flux2_klein/family.py, models/z_image/, config/) and the UI (extension/, which never imports torch
and, inside an AUTOMATIC1111 with pydantic 1, cannot import stabletune_core.config either) tell the transformer
families' models by these rules, one per family:

* FLUX.2 Klein: a diffusers folder whose model_index.json names a Flux2Klein pipeline, or a single file with FLUX.2's
  modulation layer and without FLUX.2 dev's guidance input (ComfyUI's and diffusers' markers);
* Z-Image: a diffusers folder whose model_index.json names ZImagePipeline, or a single transformer file with
  Lumina2's caption embedder and Z-Image's modulation (ComfyUI's test), in the original or diffusers' names.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, NamedTuple

#: The family whose adapter files load in some host programs only by kind (config/hosts.py) and whose training
#: memory the UI estimates before Start (models/flux2_klein/memory.py).
KLEIN = "flux2_klein"
#: The family a training adapter is merged into and whose LoRAs load in ComfyUI and diffusers only.
Z_IMAGE = "z_image"
#: What a diffusers folder's model_index.json `_class_name` starts with for a FLUX.2 Klein model.
KLEIN_PIPELINE_PREFIX = "Flux2Klein"
#: FLUX.2's single-file markers (BFL keys, after an all-in-one file's prefix is taken off).
FLUX2_MODULATION_KEY = "double_stream_modulation_img.lin.weight"
FLUX2_DEV_GUIDANCE_KEY = "guidance_in.in_layer.weight"
ALL_IN_ONE_PREFIX = "model.diffusion_model."
#: SDXL: what its diffusers folder's model_index.json `_class_name` starts with, and the second text encoder's key
#: prefix that only an SDXL single file has (the engine's rule in models/__init__.py detect_family).
SDXL = "sdxl"
SDXL_PIPELINE_PREFIX = "StableDiffusionXL"
SDXL_SECOND_TEXT_ENCODER_PREFIX = "conditioner.embedders.1."
#: The families the engine's memory plan covers (models/memory_plan.py FAMILY_MEMORY_MODELS; a test keeps them equal).
PLANNED_FAMILIES = (KLEIN, SDXL, Z_IMAGE)
#: What a Z-Image diffusers folder's model_index.json `_class_name` is.
Z_IMAGE_PIPELINE = "ZImagePipeline"
#: Keys only a Z-Image transformer has: Lumina2's caption embedder with Z-Image's modulation (ComfyUI's
#: comfy/model_detection.py; Lumina 2's blocks carry adaLN_modulation.1), in the original names with a fused qkv ...
Z_IMAGE_MARKERS = ("cap_embedder.1.weight", "layers.0.adaLN_modulation.0.weight")
Z_IMAGE_FUSED_QKV = re.compile(r"(.+\.attention)\.qkv\.(weight|bias)")
#: ... or in diffusers' names (a ZImageTransformer2DModel saved as one file).
Z_IMAGE_DIFFUSERS_MARKERS = ("cap_embedder.1.weight", "all_x_embedder.2-1.weight")
#: A safetensors header larger than this is not a model's (the real 9B's is well under 1 MB).
MAX_HEADER_BYTES = 100 * 2 ** 20


class HostWords(NamedTuple):
    """How the UI names a family whose LoRAs AUTOMATIC1111 and Forge cannot load, and where they do load."""
    name: str  # "FLUX.2 Klein"
    short: str  # "Klein", in "cannot load Klein LoRAs"
    pipeline: str  # the diffusers pipeline whose load_lora_weights reads them


#: The transformer families, which the WebUIs cannot run (their LoRAs load in ComfyUI and diffusers), declared once
#: for the UI (extension/validation.py, extension/webui.py, extension/tabs/model.py).
TRANSFORMER_FAMILIES: dict[str, HostWords] = {
    KLEIN: HostWords("FLUX.2 Klein", "Klein", "Flux2KleinPipeline"),
    Z_IMAGE: HostWords("Z-Image", "Z-Image", Z_IMAGE_PIPELINE),
}


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


def z_image_file_layout(keys: Any) -> str:
    """'original' (Tongyi-MAI / ComfyUI names), 'diffusers' (a ZImageTransformer2DModel saved as one file) or
    'other', from a single file's tensor names (with or without an all-in-one file's prefix)."""
    bare = {k.removeprefix(ALL_IN_ONE_PREFIX) for k in keys}
    if all(m in bare for m in Z_IMAGE_MARKERS) and any(Z_IMAGE_FUSED_QKV.fullmatch(k) for k in bare):
        return "original"
    if all(m in bare for m in Z_IMAGE_DIFFUSERS_MARKERS):
        return "diffusers"
    return "other"


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


def file_family(source: str | Path) -> str | None:
    """KLEIN or Z_IMAGE for a diffusers folder or single transformer file of that family; None for anything else
    (the Stable Diffusion families included) or anything unreadable."""
    path = Path(str(source)).expanduser()
    try:
        if path.is_file() and path.suffix.lower() == ".safetensors":
            keys = safetensors_keys(path)
            if flux2_file_kind(keys) == "klein":
                return KLEIN
            return Z_IMAGE if z_image_file_layout(keys) != "other" else None
        if path.is_dir():
            index = path / "model_index.json"
            model_index = json.loads(index.read_text()) if index.is_file() else {}
            if names_klein_pipeline(model_index):
                return KLEIN
            return Z_IMAGE if model_index.get("_class_name") == Z_IMAGE_PIPELINE else None
    except (OSError, ValueError, AttributeError):
        pass
    return None


def files_name_klein(source: str | Path) -> bool:
    """A FLUX.2 Klein diffusers folder or single (BFL-layout) transformer file; False for anything else or
    anything unreadable."""
    return file_family(source) == KLEIN


def files_name_z_image(source: str | Path) -> bool:
    """A Z-Image diffusers folder or single transformer file; False for anything else or anything unreadable."""
    return file_family(source) == Z_IMAGE


def files_name_sdxl(source: str | Path) -> bool:
    """An SDXL diffusers folder or single file (its second text encoder's keys); False for anything else or anything
    unreadable."""
    path = Path(str(source)).expanduser()
    try:
        if path.is_file() and path.suffix.lower() == ".safetensors":
            return any(k.startswith(SDXL_SECOND_TEXT_ENCODER_PREFIX) for k in safetensors_keys(path))
        index = path / "model_index.json"
        return index.is_file() and str(json.loads(index.read_text()).get("_class_name", "")).startswith(
            SDXL_PIPELINE_PREFIX)
    except (OSError, ValueError, AttributeError):
        return False
