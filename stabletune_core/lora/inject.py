"""Put LoRA (or LyCORIS LoHa / LoKr) adapters on the UNet and text encoders with peft, the way diffusers' own
scripts do."""
from __future__ import annotations

import difflib
from typing import Any, Callable, Protocol

import torch
from peft import LoHaConfig, LoKrConfig, LoraConfig, PeftConfig, inject_adapter_in_model

from ..config import ConfigError, TrainConfig
from .dora import use_input_axis_dora


class AdaptableFamily(Protocol):
    """What injecting adapters asks of a model family (models/base.py ModelFamily has it all)."""
    lora_target_modules: Callable[[torch.nn.Module, list[str]], list[str]] | None
    text_encoder_lora_targets: list[str]
    denoiser_name: str
    display_name: str


class AdaptableModel(Protocol):
    """What injecting adapters asks of a loaded model (models/base.py ModelBundle has it all). lora/ names it here
    rather than importing models/: the family folders import lora's primitives for their LoRA names, so an import
    back would be a circle."""
    family: AdaptableFamily
    denoiser: torch.nn.Module
    vae: torch.nn.Module
    text_encoders: list[torch.nn.Module]


def add_lora(bundle: AdaptableModel, config: TrainConfig) -> None:
    """Freeze the base model and add trainable LoRA adapters (fp32, whatever the base dtype).

    A target suffix that names no layer would silently train nothing there, so it is refused first
    (ConfigError, one sentence per suffix, with the closest real names).
    """
    targets = list(config.unet_lora_targets)
    resolve = bundle.family.lora_target_modules  # a family whose suffixes also name containers
    problems = unmatched_targets(bundle.denoiser, [t for t in targets if resolve is None or not resolve(bundle.denoiser, [t])],
                                 "unet_lora_targets", bundle.family.denoiser_name)
    if resolve is not None:
        targets = resolve(bundle.denoiser, targets)
    if config.train_text_encoder and not bundle.family.text_encoder_lora_targets:
        problems.append(f"train_text_encoder: the {bundle.family.display_name} text encoder stays frozen (LoRAs "
                        "adapt its transformer only); turn train_text_encoder off.")
    elif config.train_text_encoder:
        for i, encoder in enumerate(bundle.text_encoders):
            problems += unmatched_targets(encoder, bundle.family.text_encoder_lora_targets,
                                          "text_encoder_lora_targets", f"text encoder {i + 1}")
    if problems:
        raise ConfigError(problems)
    bundle.denoiser.requires_grad_(False)
    bundle.vae.requires_grad_(False)
    for encoder in bundle.text_encoders:
        encoder.requires_grad_(False)
    bundle.denoiser.add_adapter(adapter_config(config, targets))
    adapted = [bundle.denoiser]
    if config.train_text_encoder:
        # peft's own injection makes the same modules as PreTrainedModel.add_adapter and does not depend on
        # transformers' peft version gate (5.24+ refuses peft < 0.22 there; requirements.txt pins 5.23).
        for encoder in bundle.text_encoders:
            inject_adapter_in_model(adapter_config(config, list(bundle.family.text_encoder_lora_targets)), encoder,
                                    adapter_name="default")
            adapted.append(encoder)
    if config.use_dora:
        for model in adapted:
            use_input_axis_dora(model)


def adapter_config(config: TrainConfig, targets: list[str]) -> PeftConfig:
    """peft's config for the chosen network_type. LoHa/LoKr use their plain (non-Tucker) conv form, the one
    every WebUI loader reads; lora_dropout becomes their module dropout (a whole adapter off for a step)."""
    if config.network_type == "loha":
        return LoHaConfig(r=config.lora_rank, alpha=config.effective_lora_alpha, target_modules=targets,
                          module_dropout=config.lora_dropout, use_effective_conv2d=False)
    if config.network_type == "lokr":
        return LoKrConfig(r=config.lora_rank, alpha=config.effective_lora_alpha, target_modules=targets,
                          module_dropout=config.lora_dropout, use_effective_conv2d=False,
                          decompose_factor=config.lokr_factor)
    return LoraConfig(r=config.lora_rank, lora_alpha=config.effective_lora_alpha, lora_dropout=config.lora_dropout,
                      init_lora_weights="gaussian", target_modules=targets, use_dora=config.use_dora)


def adapter_settings(config: TrainConfig) -> dict[str, Any]:
    """The settings that shape the adapter's tensors and what they mean, and the optimizer whose state is kept for
    them: a checkpoint records them, and a resume that asks for other ones is refused (`adapter_mismatch`) before
    anything is written. (Another optimizer's state loaded as its own: Lion silently took AdamW's moments and
    betas, Prodigy and schedule-free failed with a KeyError.)"""
    settings: dict[str, Any] = {"network_type": config.network_type, "use_dora": config.use_dora,
                                "lora_rank": config.lora_rank, "lora_alpha": float(config.effective_lora_alpha),
                                "unet_lora_targets": list(config.unet_lora_targets),
                                "train_text_encoder": config.train_text_encoder, "optimizer": config.optimizer}
    if config.network_type == "lokr":
        settings["lokr_factor"] = config.lokr_factor
    settings["pivotal_tokens"] = list(config.pivotal_tokens)  # the new token rows the checkpoint holds
    # the frozen base the adapter was fitted to: a resume never changes its storage silently (issue 36)
    settings["base_storage"] = config.base_storage
    if config.pivotal_tokens:
        settings["num_vectors_per_token"] = config.num_vectors_per_token
    return settings


def adapter_mismatch(recorded: dict[str, Any], config: TrainConfig, checkpoint: str) -> str | None:
    """One sentence naming every adapter setting `config` changes from the `recorded` ones, with both values; None
    when they agree. An alpha that only follows a changed rank (lora_alpha left empty) is not named twice."""
    wanted = adapter_settings(config)
    if recorded:  # recorded before pivotal tuning existed: it trained no new tokens
        recorded = {"pivotal_tokens": [], **recorded}
    changed = [key for key in wanted if key in recorded and recorded[key] != wanted[key]]
    if "lora_rank" in changed and "lora_alpha" in changed and config.lora_alpha is None:
        changed.remove("lora_alpha")
    if not changed:
        return None

    def shown(value: Any) -> str:
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, list):
            return ", ".join(map(str, value))
        return f"{value:g}" if isinstance(value, float) else str(value)

    old = "; ".join(f"{key} {shown(recorded[key])}" for key in changed)
    new = "; ".join(f"{key} {shown(wanted[key])}" for key in changed)
    return (f"Cannot resume from {checkpoint}: it was trained with {old}, but this run asks for {new}; a "
            "checkpoint's adapter and optimizer state only fit the settings they were trained with, so resume with "
            "its values, or train with the new ones in another --output_dir.")


#: Layer types peft can put a LoRA on (what a target suffix must name to train anything).
ADAPTABLE = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Embedding)


def unmatched_targets(model: torch.nn.Module, targets: list[str], knob: str, what: str) -> list[str]:
    """One sentence per target suffix that matches no layer LoRA can adapt (peft's rule: the module name is the
    suffix, or ends with '.' + suffix), naming the closest real suffixes."""
    layers = {name: type(m).__name__ for name, m in model.named_modules() if name}
    adaptable = [name for name, m in model.named_modules() if isinstance(m, ADAPTABLE)]
    problems = []
    for target in targets:
        matched = [n for n in layers if n == target or n.endswith("." + target)]
        if any(n in adaptable for n in matched):
            continue
        if matched:
            kinds = ", ".join(sorted({layers[n] for n in matched}))
            problems.append(f"{knob}: '{target}' names only {kinds} layers of the {what}, which LoRA cannot adapt; "
                            f"use Linear or Conv layers such as {_closest(target, adaptable)}.")
        else:
            problems.append(f"{knob}: '{target}' matches no layer of the {what}, so it would train nothing; "
                            f"the closest real names are {_closest(target, adaptable)}.")
    return problems


def _closest(target: str, names: list[str]) -> str:
    """The real suffixes (last one to three name parts) nearest to `target`, for a 'did you mean'."""
    suffixes = {".".join(n.split(".")[-k:]) for n in names for k in (1, 2, 3)}
    suffixes = sorted(s for s in suffixes if not s[0].isdigit())
    close = difflib.get_close_matches(target, suffixes, n=3, cutoff=0.4) or suffixes[:3]
    return ", ".join(close)


#: How peft names the parameters of each adapter kind (lora_A/lora_B, hada_w1_a..., lokr_w1...).
ADAPTER_PARAMETER_MARKERS = ("lora_", "hada_", "lokr_")


def is_adapter_parameter(name: str) -> bool:
    return any(marker in name for marker in ADAPTER_PARAMETER_MARKERS)


def lora_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for n, p in module.named_parameters() if is_adapter_parameter(n) and p.requires_grad]


def lora_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights by their module names: what a checkpoint keeps."""
    return {n: p.detach().clone() for n, p in module.named_parameters() if is_adapter_parameter(n)}


def load_lora_state_dict(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = dict(module.named_parameters())
    missing = [n for n in state if n not in params]
    if missing:
        raise ValueError(f"The checkpoint has LoRA weights this model lacks (first: {missing[0]}); it was made "
                         "with other targets or another model.")
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)
