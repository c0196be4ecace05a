"""Put LoRA adapters on the UNet and text encoders with peft, the way diffusers' own scripts do."""
from __future__ import annotations

import torch
from peft import LoraConfig, inject_adapter_in_model

from ..config import TrainConfig
from ..models.base import ModelBundle


def add_lora(bundle: ModelBundle, config: TrainConfig) -> None:
    """Freeze the base model and add trainable LoRA adapters (fp32, whatever the base dtype)."""
    bundle.unet.requires_grad_(False)
    bundle.vae.requires_grad_(False)
    for encoder in bundle.text_encoders:
        encoder.requires_grad_(False)
    lora = dict(r=config.lora_rank, lora_alpha=config.effective_lora_alpha, lora_dropout=config.lora_dropout,
                init_lora_weights="gaussian")
    bundle.unet.add_adapter(LoraConfig(target_modules=list(config.unet_lora_targets), **lora))
    if config.train_text_encoder:
        # transformers 5 refuses PreTrainedModel.add_adapter with peft < 0.22; peft's own injection makes the
        # same modules and works with every version.
        for encoder in bundle.text_encoders:
            inject_adapter_in_model(LoraConfig(target_modules=list(bundle.family.text_encoder_lora_targets), **lora),
                                    encoder, adapter_name="default")


def lora_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for n, p in module.named_parameters() if "lora_" in n and p.requires_grad]


def lora_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights by their module names: what a checkpoint keeps."""
    return {n: p.detach().clone() for n, p in module.named_parameters() if "lora_" in n}


def load_lora_state_dict(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = dict(module.named_parameters())
    missing = [n for n in state if n not in params]
    if missing:
        raise ValueError(f"The checkpoint has LoRA weights this model lacks (first: {missing[0]}); it was made "
                         "with other targets or another model.")
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)
