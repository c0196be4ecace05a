"""Optimizer and learning-rate schedule from the config."""
from __future__ import annotations

import torch
from diffusers.optimization import get_scheduler

from ..config import TrainConfig


def make_optimizer(param_groups: list[dict], config: TrainConfig) -> torch.optim.Optimizer:
    betas = (config.adam_beta1, config.adam_beta2)
    if config.optimizer == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError as exc:
            raise RuntimeError("optimizer=adamw8bit needs bitsandbytes: pip install bitsandbytes "
                               "(GPU only), or choose adamw.") from exc
        return bnb.optim.AdamW8bit(param_groups, lr=config.learning_rate, betas=betas,
                                   weight_decay=config.adam_weight_decay, eps=config.adam_epsilon)
    if config.optimizer == "prodigy":
        try:
            from prodigyopt import Prodigy
        except ImportError as exc:
            raise RuntimeError("optimizer=prodigy needs prodigyopt: pip install prodigyopt.") from exc
        return Prodigy(param_groups, lr=config.learning_rate, betas=betas, weight_decay=config.adam_weight_decay,
                       eps=config.adam_epsilon, safeguard_warmup=config.lr_warmup_steps > 0,
                       use_bias_correction=True)
    return torch.optim.AdamW(param_groups, lr=config.learning_rate, betas=betas,
                             weight_decay=config.adam_weight_decay, eps=config.adam_epsilon)


def make_lr_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig, max_steps: int):
    name = config.lr_scheduler
    if name == "plateau":
        # Constant after the warm-up; the plateau guard lowers it when validation loss stalls.
        name = "constant_with_warmup"
    return get_scheduler(name, optimizer=optimizer, num_warmup_steps=config.lr_warmup_steps,
                         num_training_steps=max_steps, num_cycles=config.lr_num_cycles, power=config.lr_power)


def unet_block(name: str) -> str:
    """'down', 'mid' or 'up' for a UNet parameter name; 'other' outside the three block stacks."""
    for prefix, block in (("down_blocks.", "down"), ("mid_block.", "mid"), ("up_blocks.", "up")):
        if name.startswith(prefix) or f".{prefix}" in name:
            return block
    return "other"


def unet_param_groups(unet: torch.nn.Module, config: TrainConfig) -> list[dict]:
    """The UNet LoRA parameters as optimizer groups, one per distinct block learning rate.

    down/mid/up_lr_scale multiply learning_rate for their blocks; a block at 0 is frozen (its LoRA stays at
    its initial, zero update and is left out of the optimizer). With every scale at 1 this is one group, as
    without block-wise rates. The full-rate group comes first, so the logged `lr` is the run's rate.
    """
    scales = {"down": config.down_lr_scale, "mid": config.mid_lr_scale, "up": config.up_lr_scale, "other": 1.0}
    by_scale: dict[float, list[torch.nn.Parameter]] = {}
    for name, p in unet.named_parameters():
        if "lora_" not in name or not p.requires_grad:
            continue
        scale = scales[unet_block(name)]
        if scale == 0:
            p.requires_grad_(False)
            continue
        by_scale.setdefault(scale, []).append(p)
    order = sorted(by_scale, key=lambda scale: scale != 1.0)
    return [{"params": by_scale[scale], "lr": config.learning_rate * scale, "lr_scale": scale} for scale in order]
