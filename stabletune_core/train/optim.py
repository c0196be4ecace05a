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
                       safeguard_warmup=config.lr_warmup_steps > 0, use_bias_correction=True)
    return torch.optim.AdamW(param_groups, lr=config.learning_rate, betas=betas,
                             weight_decay=config.adam_weight_decay, eps=config.adam_epsilon)


def make_lr_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig, max_steps: int):
    name = config.lr_scheduler
    if name == "plateau":
        # Stepped on validation loss by the plateau guard, constant otherwise.
        name = "constant"
    return get_scheduler(name, optimizer=optimizer, num_warmup_steps=config.lr_warmup_steps,
                         num_training_steps=max_steps, num_cycles=config.lr_num_cycles, power=config.lr_power)
