"""From a TrainConfig to a loaded ModelBundle: pick the family, then let it load."""
from __future__ import annotations

from ..config import TrainConfig
from . import detect_family, get_family
from .base import ModelBundle


def family_name(config: TrainConfig) -> str:
    if config.model_family != "auto":
        return config.model_family
    return detect_family(config.pretrained_model_name_or_path)


def load_model(config: TrainConfig) -> ModelBundle:
    """The model as the config asks, its prediction type overridden when `prediction_type` is set."""
    family = get_family(family_name(config))
    bundle = family.load(config.pretrained_model_name_or_path, local_files_only=config.local_files_only,
                         config_dir=config.model_config_dir)
    if config.prediction_type:
        bundle.noise_scheduler.register_to_config(prediction_type=config.prediction_type)
    return bundle
