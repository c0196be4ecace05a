"""Validation images from another model than the one being trained (`preview_model`), the trained adapters
applied to it: LoRAs trained on FLUX.2 Klein's step-distilled model come out grey or generic, so users train on
the base and look at the result on the distilled model, which is what they will run it on.

Only the denoiser is the preview model's; the text encoders, tokenizers and VAE are the trained model's (Klein
base and distilled share them), so the preview costs one more denoiser in memory, not a second model.
"""
from __future__ import annotations

import dataclasses

import torch

from ..config import ConfigError, TrainConfig
from ..lora.inject import add_lora, is_adapter_parameter, load_lora_state_dict, lora_state_dict
from ..models.base import ModelBundle, ModelLoadError
from ..models.loading import load_model
from .outcome import RunFailed
from .placement import cast_and_place


def load_preview(config: TrainConfig, bundle: ModelBundle, device: torch.device, dtype: torch.dtype) -> ModelBundle:
    """The preview model's denoiser with the run's adapters (still untrained) beside the trained bundle's other
    modules, on `device` in `dtype`. One sentence when it is not a model of the same family and layout."""
    source = str(config.preview_model)
    try:
        # without the training adapter: the preview shows the trained LoRA on the model as users run it
        loaded = load_model(config.model_copy(update={"pretrained_model_name_or_path": source,
                                                      "training_adapter": None}))
    except ModelLoadError as exc:
        raise RunFailed(f"preview_model: {exc}") from None
    if loaded.family.name != bundle.family.name:
        raise ConfigError([f"preview_model {source} is a {loaded.family.display_name} model but the run trains "
                           f"{bundle.family.display_name}; choose a model of the same family."])
    preview = dataclasses.replace(bundle, denoiser=loaded.denoiser, source=source, extra={**bundle.extra, **loaded.extra})
    del loaded  # its own text encoders and VAE are not kept
    add_lora(preview, config)
    ours = lora_state_dict(bundle.denoiser)
    theirs = {name: p.shape for name, p in preview.denoiser.named_parameters()}
    wrong = next((name for name, t in ours.items() if theirs.get(name) != t.shape), None)
    if wrong is not None:
        raise ConfigError([f"preview_model {source} is not the same architecture as the trained model (its "
                           f"{wrong.split('.lora')[0]} differs), so the LoRA cannot be applied to it; choose the "
                           "matching model (e.g. FLUX.2 Klein 4B distilled for a 4B base)."])
    cast_and_place(preview.denoiser, device, dtype)
    for name, p in preview.denoiser.named_parameters():  # adapters in fp32, as the trained ones (setup.py)
        if is_adapter_parameter(name):
            p.data = p.data.float()
    preview.denoiser.requires_grad_(False)
    preview.denoiser.eval()
    return preview


def with_trained_adapters(preview: ModelBundle, trained: torch.nn.Module) -> ModelBundle:
    """`preview` with the adapter weights `trained` holds now (the EMA's while the caller swapped them in)."""
    load_lora_state_dict(preview.denoiser, lora_state_dict(trained))
    return preview


def preview_adapters(preview: ModelBundle) -> list[torch.nn.Parameter]:
    """The preview denoiser's adapter weights (fp32 copies of the trained ones): what a precision switch leaves
    alone when it recasts the preview's frozen weights."""
    return [p for name, p in preview.denoiser.named_parameters() if is_adapter_parameter(name)]
