"""A kohya/A1111 adapter file as modules with their update, and the model's layers under kohya names.

The update of one module, as A1111, Forge and ComfyUI apply it (see tests/test_lycoris.py, tests/test_dora.py):

* LoRA:  dW = alpha / rank x up @ down (conv factors flattened, reshaped to the weight)
* LoHa:  dW = alpha / dim x (w1_a @ w1_b) * (w2_a @ w2_b), dim = hada_w1_b's rank
* LoKr:  dW = scale x kron(w1, w2), w = the full factor or its low-rank pair; scale = alpha / dim of the pair,
         1 without one
* DoRA:  W' = dora_scale x (W + dW) / ||W + dW||, the norm per input channel; its update is W' - W

A merge at weight m adds m x (W' - W): the WebUIs' multiplier.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from ..lora.lycoris import LOHA_PARTS, LOKR_PARTS
from ..lora.names import (ALPHA, DORA_SCALE, DOWN, UP, kohya_sgm_unet_name, kohya_te_name, kohya_unet_name,
                          module_and_part)
from ..lora.resize import is_bundled
from .common import refuse

LORA_PARTS = (DOWN, UP)
KNOWN_PARTS = set(LORA_PARTS) | set(LOHA_PARTS) | set(LOKR_PARTS) | {ALPHA, DORA_SCALE}
#: ss_base_model_version prefixes -> family
VERSION_FAMILY = (("sdxl", "sdxl"), ("sd_v2", "sd2"), ("sd_v1", "sd1"))
FAMILY_NAMES = {"sd1": "Stable Diffusion 1.x", "sd2": "Stable Diffusion 2.x", "sdxl": "SDXL"}


@dataclass
class AdapterModule:
    name: str  # kohya module name, e.g. lora_unet_down_blocks_0_attentions_0_proj_in
    parts: dict[str, torch.Tensor]  # suffix after the module name -> tensor

    @property
    def kind(self) -> str:
        if "hada_w1_a" in self.parts:
            return "loha"
        if any(p.startswith("lokr_") for p in self.parts):
            return "lokr"
        return "dora" if DORA_SCALE in self.parts else "lora"

    @property
    def rank(self) -> int:
        return int(self.parts[DOWN].shape[0])

    @property
    def scale(self) -> float:
        """alpha / rank of a LoRA module (kohya: a missing alpha is the rank)."""
        alpha = self.parts.get(ALPHA)
        return (float(alpha) if alpha is not None else float(self.rank)) / self.rank

    def delta(self, weight: torch.Tensor) -> torch.Tensor:
        """W' - W for the layer weight `weight`, in float64 and the weight's shape."""
        p = {k: v.double() for k, v in self.parts.items()}
        base = weight.double()
        if self.kind == "loha":
            update = (p["hada_w1_a"] @ p["hada_w1_b"]) * (p["hada_w2_a"] @ p["hada_w2_b"])
            update = update * (p[ALPHA].item() / p["hada_w1_b"].shape[0] if ALPHA in p else 1.0)
        elif self.kind == "lokr":
            w1 = p["lokr_w1"] if "lokr_w1" in p else p["lokr_w1_a"] @ p["lokr_w1_b"]
            w2 = p["lokr_w2"] if "lokr_w2" in p else p["lokr_w2_a"] @ p["lokr_w2_b"]
            if w2.dim() == 4:
                w1 = w1[:, :, None, None]
            pair = p.get("lokr_w2_b", p.get("lokr_w1_b"))
            scale = p[ALPHA].item() / pair.shape[0] if pair is not None and ALPHA in p else 1.0
            update = torch.kron(w1, w2) * scale
        else:
            update = p[UP].flatten(1) @ p[DOWN].flatten(1) * self.scale
        if update.numel() != base.numel():
            raise ValueError(f"{tuple(update.shape)} vs {tuple(base.shape)}")
        update = update.reshape(base.shape)
        if self.kind == "dora":
            merged = base + update
            norm = merged.transpose(0, 1).reshape(merged.shape[1], -1).norm(dim=1)
            factor = p[DORA_SCALE].flatten() / norm
            factor = factor.reshape(1, -1, *[1] * (base.dim() - 2))
            update = merged * factor - base
        return update


def read_adapter(path: Path) -> tuple[dict[str, AdapterModule], dict[str, str]]:
    """{module name: AdapterModule} and the metadata of a kohya-format file; one sentence for anything else."""
    from safetensors import safe_open

    path = Path(path).expanduser()
    if not path.is_file():
        raise refuse(f"The LoRA file {path} does not exist; give the path of a .safetensors LoRA.")
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            metadata = dict(f.metadata() or {})
    except Exception as exc:
        raise refuse(f"{path} is not a readable .safetensors file ({type(exc).__name__}); give a kohya/A1111 "
                     "LoRA file.") from None
    if any(".lora_A." in k or k.endswith(".lora_A.weight") for k in tensors):
        raise refuse(f"{path.name} is a diffusers/PEFT-format LoRA (lora_A/lora_B keys); the tools take the "
                     "kohya/A1111 format (lora_unet_... keys) that StableTune exports by default.")
    modules: dict[str, AdapterModule] = {}
    for key, value in tensors.items():
        if is_bundled(key):  # pivotal tuning's words: not a module (bundled_words reads them)
            continue
        name, part = module_and_part(key)  # a FLUX.2 LoKr's module name is a dotted path (transformer.<path>)
        if part not in KNOWN_PARTS:
            what = "a Tucker (CP) LyCORIS layer" if "_t1" in part or "_t2" in part or "lora_mid" in part else \
                f"'{key}'"
            raise refuse(f"{path.name} holds {what}, which the tools cannot apply; give a LoRA, LoHa, LoKr or "
                         "DoRA file in kohya/A1111 format.")
        modules.setdefault(name, AdapterModule(name, {})).parts[part] = value
    for module in modules.values():
        if module.kind in ("lora", "dora") and not set(LORA_PARTS) <= set(module.parts):
            raise refuse(f"{path.name} has '{module.name}' without both lora_down and lora_up; the file is damaged.")
    if not modules:
        raise refuse(f"{path.name} holds no LoRA modules; give a kohya/A1111 LoRA file.")
    return modules, metadata


def bundled_words(path: Path) -> dict[str, torch.Tensor]:
    """The `bundle_emb.*` tensors of a LoRA file (pivotal tuning's words, lora/pivotal.py), by key."""
    from safetensors import safe_open

    with safe_open(str(Path(path).expanduser()), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if is_bundled(k)}


def word_names(keys: Iterable[str]) -> list[str]:
    """'<p1>' from 'bundle_emb.<p1>.string_to_param.*' (A1111's split: the name sits between the first two dots)."""
    return sorted({key.split(".", 2)[1] for key in keys})


def family_of_metadata(metadata: dict[str, str]) -> str | None:
    version = metadata.get("ss_base_model_version", "") or metadata.get("modelspec.architecture", "")
    for prefix, family in VERSION_FAMILY:
        if version.startswith(prefix) or (prefix == "sdxl" and "stable-diffusion-xl" in version):
            return family
    if "stable-diffusion-v2" in version:
        return "sd2"
    if "stable-diffusion-v1" in version:
        return "sd1"
    return None


def family_of_names(names: list[str]) -> str | None:
    """A guess from the module names alone: SDXL files have two text encoders and SGM UNet names."""
    if any(n.startswith(("lora_te1_", "lora_te2_")) or n.startswith("lora_unet_input_blocks") or
           n.startswith("lora_unet_output_blocks") or n.startswith("lora_unet_middle_block") for n in names):
        return "sdxl"
    if any(n.startswith(("lora_unet_down_blocks", "lora_unet_up_blocks", "lora_unet_mid_block", "lora_te_"))
           for n in names):
        return None  # SD 1.x and 2.x share these names; their shapes tell them apart
    return None


def check_family(path: Path, modules: dict[str, AdapterModule], metadata: dict[str, str], family: str) -> None:
    """One sentence when a LoRA was made for another model family than `family`."""
    made_for = family_of_metadata(metadata) or family_of_names(list(modules))
    if made_for is not None and made_for != family:
        raise refuse(f"{Path(path).name} is a {FAMILY_NAMES[made_for]} LoRA and the model is "
                     f"{FAMILY_NAMES[family]}; use a LoRA made for this model's family.")


def kohya_layers(bundle) -> dict[str, torch.nn.Module]:
    """Every Linear and Conv2d layer of the UNet and text encoders under its kohya name (SDXL UNet layers also
    under their diffusers-style name, which some SDXL files use)."""
    family = bundle.family
    sgm = getattr(family, "kohya_unet_naming", "diffusers") == "sgm"
    layers: dict[str, torch.nn.Module] = {}
    kinds = (torch.nn.Linear, torch.nn.Conv2d)
    for path, module in bundle.unet.named_modules():
        if isinstance(module, kinds):
            layers[kohya_unet_name(path)] = module
            if sgm:
                layers[kohya_sgm_unet_name(path, bundle.unet.config)] = module
    for prefix, encoder in zip(family.text_encoder_kohya_prefixes, bundle.text_encoders):
        for path, module in encoder.named_modules():
            if isinstance(module, kinds):
                layers[kohya_te_name(path, prefix)] = module
    return layers


def walk_layers(bundle, *, conv: bool) -> Iterator[tuple[str, str, torch.nn.Module]]:
    """(component, kohya name, layer) of the layers LoRA usually trains: the UNet's transformer blocks (every
    Linear and 1x1 conv inside `attentions`), with `conv` also its ResNet and sampler convolutions, and the
    text encoders' attention and MLP layers. Names as the exporter writes them (SGM names for SDXL)."""
    family = bundle.family
    sgm = getattr(family, "kohya_unet_naming", "diffusers") == "sgm"
    for path, module in bundle.unet.named_modules():
        if not isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
            continue
        in_transformer = ".attentions." in f".{path}."
        is_conv = isinstance(module, torch.nn.Conv2d) and module.kernel_size != (1, 1)
        if (in_transformer and not is_conv) or (conv and is_conv and not in_transformer):
            yield "unet", kohya_sgm_unet_name(path, bundle.unet.config) if sgm else kohya_unet_name(path), module
    for i, (prefix, encoder) in enumerate(zip(family.text_encoder_kohya_prefixes, bundle.text_encoders)):
        for path, module in encoder.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in f".{path}":
                yield f"text_encoder{'' if i == 0 else '_2'}", kohya_te_name(path, prefix), module
