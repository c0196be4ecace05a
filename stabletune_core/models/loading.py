"""From a TrainConfig to a loaded ModelBundle: pick the family, then let it load; and what every family's loader
asks first (what the user pointed at, a single file's header)."""
from __future__ import annotations

from pathlib import Path

from ..config import PICKLE_SUFFIXES, TrainConfig
from ..config.families import model_file_options, text_options
from . import detect_family, get_family
from .base import ModelBundle, ModelLoadError

#: The families detect_family names only on positive evidence (a pipeline class, a transformer's keys), unlike its
#: "sd1 when unsure": a model of one of them under another family's name is refused before the wrong loader fails.
RECOGNISED_FOR_SURE = ("flux2_klein", "z_image")
SINGLE_FILE_SUFFIXES = {".safetensors"}


def family_name(config: TrainConfig) -> str:
    if config.model_family != "auto":
        return config.model_family
    return detect_family(config.pretrained_model_name_or_path)


def load_model(config: TrainConfig) -> ModelBundle:
    """The model as the config asks, its prediction type overridden when `prediction_type` is set. A FLUX.2 Klein
    model under another family's name is refused in one sentence, before the wrong loader fails on it."""
    name = family_name(config)
    detected = detect_family(config.pretrained_model_name_or_path)
    if name != detected and detected in RECOGNISED_FOR_SURE:
        raise ModelLoadError(f"'{config.pretrained_model_name_or_path}' is a {get_family(detected).display_name} "
                             f"model, but model_family is {name}; set model_family to {detected} (or auto).")
    bundle = get_family(name).load(config.pretrained_model_name_or_path, local_files_only=config.local_files_only,
                                   config_dir=config.model_config_dir, **model_file_options(config),
                                   **text_options(config))
    if config.prediction_type:
        bundle.noise_scheduler.register_to_config(prediction_type=config.prediction_type)
    if config.training_adapter:  # only Z-Image takes one (config/families.py refuses it elsewhere)
        from .z_image.adapter import merge_training_adapter

        merge_training_adapter(bundle, config.training_adapter)
    return bundle


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
    """(tensor name -> shape, metadata) of a .safetensors file, read from its header without loading a tensor."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}, dict(f.metadata() or {})
