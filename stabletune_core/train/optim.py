"""Optimizer and learning-rate schedule from the config."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from diffusers.optimization import get_scheduler

from ..config import TrainConfig
from ..lora.inject import is_adapter_parameter
from .lr_schedule import LearningRateSchedule


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
    if config.optimizer in OPTIONAL_OPTIMIZERS:
        return make_optional_optimizer(param_groups, config)
    return torch.optim.AdamW(param_groups, lr=config.learning_rate, betas=betas,
                             weight_decay=config.adam_weight_decay, eps=config.adam_epsilon,
                             fused=fused_kernel_fits(param_groups))


def fused_kernel_fits(param_groups: list[dict]) -> bool:
    """Whether torch's fused AdamW kernel can update these tensors. It is the same update in one kernel instead
    of a loop over a LoRA's hundreds of small tensors: 0.7 vs 3.5-4.3 ms per step for 160 tensors on one CPU
    thread (a few % of a tiny model's step), equal to the default within fp32 rounding."""
    return all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point
               for group in param_groups for p in group["params"])


# ---- Lion, Adafactor, schedule-free AdamW (issue 13) ---------------------------------------------------------
#: optimizer -> (module to import, pinned package that provides it)
OPTIONAL_OPTIMIZERS = {"lion": ("lion_pytorch", "lion-pytorch==0.2.5"),
                       "adafactor": ("transformers", "transformers==5.24.0"),
                       "adamw_schedulefree": ("schedulefree", "schedulefree==1.4.1")}


#: Optimizers make_optimizer builds from other packages too: checked with the optional ones, before any model loads
#: (a missing one was an internal error after the model had loaded).
PACKAGED_OPTIMIZERS = {"adamw8bit": ("bitsandbytes", "bitsandbytes"), "prodigy": ("prodigyopt", "prodigyopt==1.1.2")}


def optimizer_problems(config: TrainConfig) -> list[str]:
    """One sentence when the chosen optimizer's package is missing (checked before any model loads)."""
    import importlib.util

    needs = {**OPTIONAL_OPTIMIZERS, **PACKAGED_OPTIMIZERS}
    if config.optimizer not in needs:
        return []
    module, package = needs[config.optimizer]
    if importlib.util.find_spec(module) is None:
        where = " (GPU only)" if config.optimizer == "adamw8bit" else ""
        return [f"optimizer={config.optimizer} needs the {package.split('==')[0]} package{where}: pip install "
                f"{package} (or choose optimizer=adamw)."]
    return []


def make_optional_optimizer(param_groups: list[dict], config: TrainConfig) -> torch.optim.Optimizer:
    if config.optimizer == "lion":
        from lion_pytorch import Lion

        # Lion's paper betas (0.9, 0.99); its sign update needs a 3-10x smaller learning rate than AdamW.
        return Lion(param_groups, lr=config.learning_rate, betas=(0.9, 0.99), weight_decay=config.adam_weight_decay)
    if config.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        # A fixed learning rate, as kohya users run it (relative_step/scale_parameter/warmup_init off).
        return Adafactor(param_groups, lr=config.learning_rate, relative_step=False, scale_parameter=False,
                         warmup_init=False, weight_decay=config.adam_weight_decay)
    from schedulefree import AdamWScheduleFree

    # Schedule-free warms up by itself (lr_scheduler must be constant); it trains at one point (y) and is
    # evaluated at another (x): see `evaluation_weights`.
    optimizer = AdamWScheduleFree(param_groups, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                                  eps=config.adam_epsilon, weight_decay=config.adam_weight_decay,
                                  warmup_steps=config.lr_warmup_steps)
    optimizer.train()
    return optimizer


@contextmanager
def evaluation_weights(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside, a schedule-free optimizer's parameters are its evaluation weights (what to sample with and
    export); afterwards the training weights are put back bit for bit (its own train() recomputes them in
    floating point, which would make a run that sampled differ from one that did not). Other optimizers: no-op.
    """
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    if not any("train_mode" in group for group in inner.param_groups):
        yield
        return
    saved = [[p.detach().clone() for p in group["params"]] for group in inner.param_groups]
    modes = [group["train_mode"] for group in inner.param_groups]
    inner.eval()
    try:
        yield
    finally:
        with torch.no_grad():
            for group, copies, mode in zip(inner.param_groups, saved, modes):
                for p, copy in zip(group["params"], copies):
                    p.copy_(copy)
                group["train_mode"] = mode


def make_lr_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig, max_steps: int) -> LearningRateSchedule:
    """diffusers' schedule for `config`, wrapped so that guards can lower the rate for good (lr_schedule.py)."""
    name = config.lr_scheduler
    if config.optimizer == "adamw_schedulefree":  # it warms up itself; a schedule on top would undo its point
        return LearningRateSchedule(optimizer, lambda o: get_scheduler("constant", optimizer=o))
    if name == "plateau":
        # Constant after the warm-up; the plateau guard lowers it when validation loss stalls.
        name = "constant_with_warmup"
    return LearningRateSchedule(optimizer, lambda o: get_scheduler(
        name, optimizer=o, num_warmup_steps=config.lr_warmup_steps, num_training_steps=max_steps,
        num_cycles=config.lr_num_cycles, power=config.lr_power))


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
        if not is_adapter_parameter(name) or not p.requires_grad:
            continue
        scale = scales[unet_block(name)]
        if scale == 0:
            p.requires_grad_(False)
            continue
        by_scale.setdefault(scale, []).append(p)
    order = sorted(by_scale, key=lambda scale: scale != 1.0)
    return [{"params": by_scale[scale], "lr": config.learning_rate * scale, "lr_scale": scale} for scale in order]
