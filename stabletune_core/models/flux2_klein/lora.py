"""FLUX.2 Klein LoRA files in the names ComfyUI and diffusers read.

We train on diffusers' Flux2Transformer2DModel, whose double blocks keep q, k and v apart; the checkpoints users run
(BFL's, in ComfyUI) fuse them into one ``img_attn.qkv`` (text stream: ``txt_attn.qkv``). Two layouts result:

* LoRA: kohya names of the BFL modules, ``lora_unet_double_blocks_0_img_attn_qkv`` and so on, the layout kohya's
  musubi-tuner writes. diffusers' ``_convert_kohya_flux2_lora_to_diffusers`` reads it and ComfyUI maps it onto the
  checkpoint's own weights. A fused q/k/v LoRA is exact: its down is the parts' downs stacked (rank r_q + r_k + r_v)
  and its up places each part's up in that part's rows, zero elsewhere (diffusers recognises this block structure
  and splits it back; a part that was not trained simply has zero rows). The kohya alpha is set so that
  alpha / rank reproduces the trained scale; a part trained at another scale has it folded into its up rows.
* DoRA, LoHa, LoKr: a magnitude or a Hadamard/Kronecker product cannot be fused exactly, so these keep diffusers'
  module paths: DoRA and LoHa in SimpleTuner's LyCORIS naming, ``lycoris_transformer_blocks_0_attn_to_q``, LoKr as
  ``transformer.transformer_blocks.0.attn.to_q`` with alpha / rank folded into its left factor (diffusers' LyCORIS
  converter refuses a LoKr on x_embedder, context_embedder or proj_out; this form it loads whole). ComfyUI maps
  both onto each module's slice of the fused weight (and normalises a DoRA layer over that slice only). diffusers
  reads neither DoRA (it drops ``dora_scale``) nor LoHa for FLUX.2 (config/hosts.py says where each kind loads).

The layer walk is lora/layers.py's; only the names and the fusing live here.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

from ...lora.dora import dora_scale
from ...lora.lycoris import lycoris_tensors
from ...lora.layers import LoraLayerView
from ...lora.names import DORA_SCALE, kohya_keys
from ..base import FusedLoraExport
from .single_file import SWAPPED_HALVES, bfl_module

KOHYA_PREFIX = "lora_unet_"
LYCORIS_PREFIX = "lycoris_"
DIFFUSERS_LOKR_PREFIX = "transformer."  # a LoKr module's name: this + its diffusers path (diffusers_lokr_name)
#: BFL modules outside the blocks that diffusers' kohya FLUX.2 converter reads (the blocks' are all read).
KOHYA_TOP_LEVEL = {"img_in", "txt_in", "time_in.in_layer", "time_in.out_layer", "final_layer.linear"}


class Flux2ExportError(ValueError):
    """A layer has no name both loaders read; the message is one sentence."""


def kohya_name(bfl_path: str) -> str:
    return KOHYA_PREFIX + bfl_path.replace(".", "_")


#: Top-level modules ComfyUI maps from diffusers paths (comfy/utils.py flux_to_diffusers knows FLUX.1's
#: time_text_embed, not FLUX.2's time_guidance_embed, so the time embedding is not among them).
LYCORIS_TOP_LEVEL = {"x_embedder", "context_embedder", "proj_out"}


def lycoris_name(module_path: str) -> str:
    """The LyCORIS name of a diffusers module path; Flux2ExportError for a module ComfyUI would not map."""
    name = bfl_module(module_path)
    if name is None or not (name.path.startswith(("double_blocks.", "single_blocks.")) or
                            module_path in LYCORIS_TOP_LEVEL):
        raise Flux2ExportError(f"'{module_path}' has no LyCORIS name that ComfyUI reads for FLUX.2; leave it out of "
                               "the targets of a DoRA, LoHa or LoKr.")
    return LYCORIS_PREFIX + module_path.replace(".", "_")


def diffusers_lokr_name(module_path: str) -> str:
    """A LoKr module's name: ``transformer.`` + its diffusers path, the form diffusers' FLUX.2 loader takes for every
    module (its LyCORIS converter knows the blocks' layers only, and refuses a file with x_embedder, context_embedder
    or proj_out) and ComfyUI maps as it maps the LyCORIS name; the same modules as `lycoris_name` allows."""
    lycoris_name(module_path)  # refuses what ComfyUI would not map
    return DIFFUSERS_LOKR_PREFIX + module_path


def bake_lokr_alpha(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The LoKr tensors with each module's alpha / rank folded into its left factor and the alpha keys dropped, so
    a loader that reads no alpha (diffusers' peft LoKr; ComfyUI then scales by 1) applies the trained update. The
    scale applies only where a factor is rank-decomposed (lokr_w1_b or lokr_w2_b), as in LyCORIS, diffusers and
    ComfyUI; with both factors full, alpha is unused and simply dropped."""
    out = dict(tensors)
    for alpha_key in [k for k in out if k.endswith(".alpha")]:
        alpha = float(out.pop(alpha_key))
        module = alpha_key[:-len(".alpha")]
        low = out.get(f"{module}.lokr_w2_b", out.get(f"{module}.lokr_w1_b"))
        if low is None:
            continue
        w1 = f"{module}.lokr_w1" if f"{module}.lokr_w1" in out else f"{module}.lokr_w1_a"
        out[w1] = (out[w1].float() * (alpha / low.shape[0])).to(out[w1].dtype).contiguous()
    return out


def _bfl_target(layer: LoraLayerView):
    name = bfl_module(layer.path)
    if name is None or not (name.path.startswith(("double_blocks.", "single_blocks.")) or
                            name.path in KOHYA_TOP_LEVEL):
        raise Flux2ExportError(f"'{layer.path}' has no name in the FLUX.2 kohya format that diffusers and ComfyUI "
                               "both read; leave it out of the LoRA targets or export in the diffusers format.")
    return name


def kohya_lora_tensors(layers: list[LoraLayerView], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The LoRA (or DoRA) tensors of a Flux2Transformer2DModel's peft layers (lora/export.py's `exportable_layers`
    of it), named for ComfyUI and diffusers."""
    out: dict[str, torch.Tensor] = {}
    if any(layer.magnitude is not None for layer in layers):
        for layer in layers:
            down, up, alpha = kohya_keys(lycoris_name(layer.path))
            out[down] = _cast(layer.down, dtype)
            out[up] = _cast(layer.up, dtype)
            out[alpha] = torch.tensor(float(layer.kohya_alpha), dtype=torch.float32)
            if layer.magnitude is not None:
                out[f"{lycoris_name(layer.path)}.{DORA_SCALE}"] = _cast(dora_scale(layer), dtype)
        return out
    groups: dict[str, dict[int | None, LoraLayerView]] = {}
    for layer in layers:
        name = _bfl_target(layer)
        groups.setdefault(name.path, {})[name.part] = layer
    for bfl_path, parts in groups.items():
        down_key, up_key, alpha_key = kohya_keys(kohya_name(bfl_path))
        if None in parts:  # a module the checkpoint keeps as it is
            layer = parts[None]
            out[down_key], out[up_key] = _cast(layer.down, dtype), _cast(layer.up, dtype)
            out[alpha_key] = torch.tensor(float(layer.kohya_alpha), dtype=torch.float32)
            continue
        down, up, alpha = fuse_qkv(parts)
        out[down_key], out[up_key] = _cast(down, dtype), _cast(up, dtype)
        out[alpha_key] = torch.tensor(alpha, dtype=torch.float32)
    return out


def fuse_qkv(parts: dict[int, LoraLayerView]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(down, up, alpha) of one LoRA on a fused q/k/v weight equal to the parts' LoRAs on their thirds: kohya's
    rule alpha / rank x up @ down gives, in part p's rows, scaling_p x up_p @ down_p, and zero for a missing part."""
    present = [parts[i] for i in sorted(parts)]
    reference = present[0].scaling
    rows = present[0].up.shape[0]  # q, k and v have the same width
    rank = sum(layer.rank for layer in present)
    down = torch.cat([layer.down.detach().float() for layer in present], dim=0)
    up = torch.zeros(3 * rows, rank, dtype=torch.float32, device=down.device)
    column = 0
    for index in sorted(parts):
        layer = parts[index]
        up[index * rows:(index + 1) * rows, column:column + layer.rank] = layer.up.detach().float() * (
            layer.scaling / reference)
        column += layer.rank
    return down, up, reference * rank


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.detach().to(device="cpu", dtype=dtype).contiguous().clone()


def lokr_tensors(modules: Iterator[tuple[str, Any]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A Klein LoKr's tensors from its modules (diffusers path, parts): under transformer.<diffusers path> names, alpha
    folded in (diffusers and ComfyUI read it so)."""
    return bake_lokr_alpha(lycoris_tensors(((diffusers_lokr_name(path), parts) for path, parts in modules), dtype))


def named_modules(transformer: torch.nn.Module, blocks_only: bool) -> dict[str, list[torch.nn.Module]]:
    """A FLUX.2 transformer's Linear layers under the names its adapter files use: kohya names of BFL's modules (q, k
    and v one fused module, their layers in that row order) and, unless `blocks_only`, LyCORIS names of diffusers'
    paths and diffusers' own `transformer.` paths (our LoKr files).
    `blocks_only`: just the BFL modules of the double and single blocks (what a LoRA usually trains)."""
    named: dict[str, list[torch.nn.Module]] = {}
    fused: dict[str, dict[int, torch.nn.Module]] = {}
    for path, module in transformer.named_modules():
        if not isinstance(module, torch.nn.Linear) or path == SWAPPED_HALVES:  # BFL stores its halves swapped
            continue
        if not blocks_only:
            named[LYCORIS_PREFIX + path.replace(".", "_")] = [module]
            named[DIFFUSERS_LOKR_PREFIX + path] = [module]  # our LoKr files
        name = bfl_module(path)
        if name is None or (blocks_only and not name.path.startswith(("double_blocks.", "single_blocks."))):
            continue
        if name.part is None:
            named[kohya_name(name.path)] = [module]
        else:
            fused.setdefault(name.path, {})[name.part] = module
    for path, parts in fused.items():
        if sorted(parts) == [0, 1, 2]:
            named[kohya_name(path)] = [parts[i] for i in range(3)]
    return named


#: What lora/export.py and tools/lora_file.py ask the family for (ModelFamily.fused_lora_export).
FUSED_EXPORT = FusedLoraExport(lora_tensors=kohya_lora_tensors, lokr_tensors=lokr_tensors, named_modules=named_modules)
