"""Applying an exported file to a fresh base as the WebUIs' loaders do, written independently of our exporter,
and comparing the result with the model the engine trained (shared by the DoRA and LyCORIS tests)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

MergeRule = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]  # (weight, file parts) -> merged


def unet_name(path: str) -> str:
    return "lora_unet_" + path.replace(".", "_")


def te_name(path: str) -> str:
    return "lora_te_" + (path if path.startswith("text_model.") else "text_model." + path).replace(".", "_")


def merge_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor], kohya_name: Callable[[str], str],
               rule: MergeRule) -> set[str]:
    """Replace every weight the file names by `rule`'s merged weight; returns the names applied."""
    by_module: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        name, part = key.split(".", 1)
        by_module.setdefault(name, {})[part] = value
    applied = set()
    with torch.no_grad():
        for path, module in model.named_modules():
            parts = by_module.get(kohya_name(path))
            if parts is not None and hasattr(module, "weight"):
                module.weight.copy_(rule(module.weight, parts).to(module.weight.dtype))
                applied.add(kohya_name(path))
    return applied


@dataclass
class Outputs:
    te_trained: torch.Tensor
    te_merged: torch.Tensor
    te_base: torch.Tensor
    unet_trained: torch.Tensor
    unet_merged: torch.Tensor
    unet_base: torch.Tensor


def trained_and_merged_outputs(session, tensors: dict[str, torch.Tensor], model_path: str,
                               rule: MergeRule) -> tuple[Outputs, Callable[[dict[str, torch.Tensor]], torch.Tensor]]:
    """The trained session's text encoder and UNet outputs beside a fresh base with the file merged by `rule`
    (every module of the file must apply), and the base's. Also returns a function that gives the UNet output
    of a fresh base with other tensors merged, on the same inputs."""
    from stabletune_core.models import get_family

    family = get_family("sd1")
    fresh = family.load(model_path)
    modules = {k.split(".", 1)[0] for k in tensors}
    applied = (merge_into(fresh.denoiser, tensors, unet_name, rule)
               | merge_into(fresh.text_encoders[0], tensors, te_name, rule))
    assert applied == modules, modules - applied

    trained_unet = session.ranks.unwrap(session.trained["unet"]).eval()
    trained_te = session.ranks.unwrap(session.trained["te0"]).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, fresh.text_encoders[0].config.vocab_size, (2, 77), generator=generator)
    latents = torch.randn(2, fresh.denoiser.config.in_channels, 8, 8, generator=generator)
    steps = torch.tensor([10, 500])
    base = family.load(model_path)
    with torch.no_grad():
        te_trained = trained_te(ids)[0]

        def unet_with(other: dict[str, torch.Tensor]) -> torch.Tensor:
            unet = family.load(model_path).denoiser
            merge_into(unet, other, unet_name, rule)
            with torch.no_grad():
                return unet.eval()(latents, steps, encoder_hidden_states=te_trained).sample

        outputs = Outputs(
            te_trained=te_trained, te_merged=fresh.text_encoders[0].eval()(ids)[0],
            te_base=base.text_encoders[0](ids)[0],
            unet_trained=trained_unet(latents, steps, encoder_hidden_states=te_trained).sample,
            unet_merged=fresh.denoiser.eval()(latents, steps, encoder_hidden_states=te_trained).sample,
            unet_base=base.denoiser(latents, steps, encoder_hidden_states=te_trained).sample)
    return outputs, unet_with
