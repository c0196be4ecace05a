"""From a TrainConfig to a loaded ModelBundle: pick the family, then let it load (what every family's loader asks
first, what the user pointed at, is models/sources.py)."""
from __future__ import annotations

from ..config import TrainConfig
from ..config.families import model_file_options, text_options
from . import detect_family, get_family
from .base import ModelBundle, ModelLoadError

#: The families detect_family names only on positive evidence (a pipeline class, a transformer's keys), unlike its
#: "sd1 when unsure": a model of one of them under another family's name is refused before the wrong loader fails.
RECOGNISED_FOR_SURE = ("flux2_klein", "z_image")


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

