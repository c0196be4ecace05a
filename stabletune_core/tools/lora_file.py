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
from ..lora.names import (ALPHA, DORA_SCALE, DOWN, UP, kohya_te_name, kohya_unet_name,
                          module_and_part)
from ..lora.resize import is_bundled
from .common import refuse

LORA_PARTS = (DOWN, UP)
KNOWN_PARTS = set(LORA_PARTS) | set(LOHA_PARTS) | set(LOKR_PARTS) | {ALPHA, DORA_SCALE}


def family_display_name(family: str) -> str:
    from ..models import get_family

    return get_family(family).display_name


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
    """The family whose declared `lora_file_markers` the file's ss_base_model_version (or modelspec.architecture)
    holds, as the trainers write them; the longest marker wins. None: the metadata does not say."""
    from ..models import FAMILIES, get_family

    version = (metadata.get("ss_base_model_version", "") or metadata.get("modelspec.architecture", "")).lower()
    found = [(len(marker), name) for name in FAMILIES for marker in get_family(name).lora_file_markers
             if version and marker in version]
    return max(found)[1] if found else None


def family_of_names(names: list[str]) -> str | None:
    """A guess from the module names alone, by the prefixes only one family's files use (its declared
    `lora_module_prefixes`: SDXL's two text encoders and SGM UNet names, FLUX.2 Klein's BFL block names, ...);
    SD 1.x and 2.x share their names."""
    from ..models import FAMILIES, get_family

    for name in FAMILIES:
        prefixes = tuple(get_family(name).lora_module_prefixes)
        if prefixes and any(n.startswith(prefixes) for n in names):
            return name
    return None


def family_of_file(modules: dict[str, "AdapterModule"], metadata: dict[str, str]) -> str | None:
    """The family a LoRA file was made for, from its metadata or else its module names (None: cannot tell)."""
    return family_of_metadata(metadata) or family_of_names(list(modules))


def check_family(path: Path, modules: dict[str, AdapterModule], metadata: dict[str, str], family: str) -> None:
    """One sentence when a LoRA was made for another model family than `family`."""
    made_for = family_of_file(modules, metadata)
    if made_for is not None and made_for != family:
        raise refuse(f"{Path(path).name} is a {family_display_name(made_for)} LoRA and the model is "
                     f"{family_display_name(family)}; use a LoRA made for this model's family.")


class LayerTarget:
    """Where one module of an adapter file acts on the model: one layer, or a module the original checkpoint fuses
    from several of the model's layers (FLUX.2's q/k/v: the fused weight is theirs stacked by rows, in order)."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        self.layers = layers

    @property
    def weight(self) -> torch.Tensor:
        if len(self.layers) == 1:
            return self.layers[0].weight
        return torch.cat([layer.weight for layer in self.layers], dim=0)

    def add(self, delta: torch.Tensor) -> None:
        """weight += delta (float64 sum, stored in the weight's dtype), each layer its own rows."""
        start = 0
        for layer in self.layers:
            rows = layer.weight.shape[0]
            layer.weight.copy_((layer.weight.double() + delta[start:start + rows]).to(layer.weight.dtype))
            start += rows


def kohya_layers(bundle) -> dict[str, LayerTarget]:
    """Every module an adapter file may name, under that name: for SD families every Linear and Conv2d of the
    UNet and text encoders (under diffusers-style kohya names, and under the family's own where they differ: SDXL's
    SGM names, which most SDXL files use); for a family whose kohya names fuse modules (FLUX.2 Klein's q/k/v) the
    names and modules its `fused_lora_export` declares."""
    family = bundle.family
    if family.fused_lora_export is not None:
        return {name: LayerTarget(modules)
                for name, modules in family.fused_lora_export.named_modules(bundle.denoiser, False).items()}
    layers: dict[str, LayerTarget] = {}
    kinds = (torch.nn.Linear, torch.nn.Conv2d)
    for path, module in bundle.denoiser.named_modules():
        if isinstance(module, kinds):
            layers[kohya_unet_name(path)] = LayerTarget([module])
            layers[family.kohya_denoiser_name(path, bundle.denoiser)] = LayerTarget([module])
    for prefix, encoder in zip(family.text_encoder_kohya_prefixes, bundle.text_encoders):
        for path, module in encoder.named_modules():
            if isinstance(module, kinds):
                layers[kohya_te_name(path, prefix)] = LayerTarget([module])
    return layers


#: kohya's LoCon classes beside the transformer blocks: ResnetBlock2D, Downsample2D, Upsample2D
CONV_BLOCKS = (".resnets.", ".downsamplers.", ".upsamplers.")


def walk_layers(bundle, *, conv: bool) -> Iterator[tuple[str, str, LayerTarget]]:
    """(component, kohya name, target) of the layers LoRA usually trains, named as the exporter writes them.
    SD families: the UNet's transformer blocks (every Linear and 1x1 conv inside `attentions`), with `conv` also
    every layer of its ResNets and samplers (convolutions, `time_emb_proj`, `conv_shortcut`) and its other 3x3
    convolutions, and the text encoders' attention and MLP layers, under the family's kohya names (SGM's for
    SDXL). A family whose names fuse modules: the blocks its `fused_lora_export` names (FLUX.2 Klein: the
    transformer's double and single blocks under BFL's names, q/k/v fused), which has no convolutions."""
    family = bundle.family
    if family.fused_lora_export is not None:
        for name, modules in family.fused_lora_export.named_modules(bundle.denoiser, True).items():
            yield "unet", name, LayerTarget(modules)
        return
    for path, module in bundle.denoiser.named_modules():
        if not isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
            continue
        where = f".{path}."
        in_transformer = ".attentions." in where
        is_conv = isinstance(module, torch.nn.Conv2d) and module.kernel_size != (1, 1)
        beside = not in_transformer and (is_conv or any(block in where for block in CONV_BLOCKS))
        if (in_transformer and not is_conv) or (conv and beside):
            yield "unet", family.kohya_denoiser_name(path, bundle.denoiser), LayerTarget([module])
    for i, (prefix, encoder) in enumerate(zip(family.text_encoder_kohya_prefixes, bundle.text_encoders)):
        for path, module in encoder.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in f".{path}":
                yield f"text_encoder{'' if i == 0 else '_2'}", kohya_te_name(path, prefix), LayerTarget([module])


#: what a .safetensors file without adapter modules holds, by the prefixes of its keys (first match wins)
NOT_A_LORA = (
    (("text_model.", "embeddings.token_embedding.", "cond_stage_model.", "conditioner.embedders.", "text_encoders."),
     "a CLIP text encoder"),
    (("model.embed_tokens.", "model.layers.", "embed_tokens."), "a Qwen3 text encoder (FLUX.2 Klein's)"),
    (("model.diffusion_model.", "double_blocks.", "single_blocks.", "down_blocks.", "input_blocks.", "conv_in."),
     "a model checkpoint (UNet or transformer weights)"),
    (("encoder.down.", "decoder.up.", "encoder.down_blocks.", "decoder.up_blocks.", "first_stage_model."), "a VAE"),
    (("emb_params", "string_to_param", "clip_l", "clip_g", "string_to_token"), "a textual-inversion embedding"),
)
ADAPTER_SUFFIXES = tuple(f".{part}" for part in KNOWN_PARTS - {ALPHA}) + (".lora_A.weight", ".lora_B.weight")


def adapter_modules(keys: Iterable[str]) -> set[str]:
    """The adapter modules (LoRA, LoHa, LoKr, DoRA; kohya or PEFT names) among a file's tensor keys."""
    return {key.rsplit(".", 2 if key.endswith(".weight") and ".lora_" in key else 1)[0]
            for key in keys if key.endswith(ADAPTER_SUFFIXES)}


def not_a_lora(keys: list[str]) -> str | None:
    """What a file whose keys hold no adapter module is, e.g. "a CLIP text encoder"; None for an adapter file."""
    if adapter_modules(keys):
        return None
    for prefixes, what in NOT_A_LORA:
        if any(key.startswith(prefixes) for key in keys):
            return what
    return "a file with no LoRA modules"
