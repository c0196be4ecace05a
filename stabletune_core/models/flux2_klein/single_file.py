"""FLUX.2's original (Black Forest Labs) checkpoint layout, the one of the single files users download.

Users of ComfyUI keep FLUX.2 Klein as three files: the transformer (``models/diffusion_models/flux-2-klein-4b.safetensors``,
BFL keys such as ``double_blocks.0.img_attn.qkv.weight``), the Qwen3 text encoder (``models/text_encoders/
qwen_3_4b.safetensors``, transformers' own keys ``model.layers.0...``) and the VAE (``models/vae/flux2-vae.safetensors``,
the LDM layout of SD's VAE plus ``encoder.quant_conv``, ``decoder.post_quant_conv`` and the latent batch norm
``bn.running_mean`` / ``bn.running_var``). The names here are read off diffusers'
``convert_flux2_transformer_checkpoint_to_diffusers`` and ``scripts/convert_flux2_to_diffusers.py`` and ComfyUI's
``model_detection`` / ``sd.py``; the tables are ours.

The BFL transformer fuses what diffusers keeps apart: a double block's image q, k, v are one ``img_attn.qkv``
weight (text: ``txt_attn.qkv``, from ``add_{q,k,v}_proj``), and the final norm's modulation stores (shift, scale)
where diffusers has (scale, shift).
"""
from __future__ import annotations

import re
from typing import NamedTuple

import torch

from ..ldm_vae import ldm_vae_key

DIFFUSION_MODEL_PREFIX = "model.diffusion_model."  # a full (all-in-one) checkpoint's transformer keys

#: diffusers module path (outside the blocks) -> BFL module path.
_TOP = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "proj_out": "final_layer.linear",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
}
#: inside double block i: diffusers sub-path -> (BFL sub-path, index of the part in a fused q/k/v weight or None).
_DOUBLE = {
    "attn.to_q": ("img_attn.qkv", 0), "attn.to_k": ("img_attn.qkv", 1), "attn.to_v": ("img_attn.qkv", 2),
    "attn.add_q_proj": ("txt_attn.qkv", 0), "attn.add_k_proj": ("txt_attn.qkv", 1),
    "attn.add_v_proj": ("txt_attn.qkv", 2),
    "attn.to_out.0": ("img_attn.proj", None), "attn.to_add_out": ("txt_attn.proj", None),
    "ff.linear_in": ("img_mlp.0", None), "ff.linear_out": ("img_mlp.2", None),
    "ff_context.linear_in": ("txt_mlp.0", None), "ff_context.linear_out": ("txt_mlp.2", None),
    "attn.norm_q": ("img_attn.norm.query_norm", None), "attn.norm_k": ("img_attn.norm.key_norm", None),
    "attn.norm_added_q": ("txt_attn.norm.query_norm", None), "attn.norm_added_k": ("txt_attn.norm.key_norm", None),
}
_SINGLE = {
    "attn.to_qkv_mlp_proj": ("linear1", None), "attn.to_out": ("linear2", None),
    "attn.norm_q": ("norm.query_norm", None), "attn.norm_k": ("norm.key_norm", None),
}
_BLOCK = re.compile(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)")
SWAPPED_HALVES = "norm_out.linear"  # diffusers (scale, shift) <-> BFL (shift, scale)


class BflName(NamedTuple):
    path: str  # BFL module path, e.g. "double_blocks.0.img_attn.qkv"
    part: int | None  # which third of a fused q/k/v weight, None when the module is not fused


def bfl_module(path: str) -> BflName | None:
    """The BFL module a diffusers Flux2Transformer2DModel module maps to; None if it has none."""
    if path in _TOP:
        return BflName(_TOP[path], None)
    m = _BLOCK.fullmatch(path)
    if not m:
        return None
    kind, index, rest = m.groups()
    table, prefix = (_DOUBLE, "double_blocks") if kind == "transformer_blocks" else (_SINGLE, "single_blocks")
    if rest not in table:
        return None
    sub, part = table[rest]
    return BflName(f"{prefix}.{index}.{sub}", part)


def _bfl_param(key: str) -> tuple[BflName, str]:
    module, _, param = key.rpartition(".")
    name = bfl_module(module)
    if name is None:
        raise KeyError(f"'{key}' has no place in the FLUX.2 checkpoint layout.")
    if name.path.endswith(("query_norm", "key_norm")):
        param = "scale"  # BFL calls its RMSNorm weights scale
    return name, param


def transformer_to_bfl(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A diffusers Flux2Transformer2DModel state dict in BFL keys (q/k/v fused, the final modulation swapped)."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, list[torch.Tensor | None]] = {}
    for key, value in state.items():
        name, param = _bfl_param(key)
        target = f"{name.path}.{param}"
        if name.part is not None:
            fused.setdefault(target, [None, None, None])[name.part] = value
            continue
        if key.startswith(SWAPPED_HALVES + "."):
            scale, shift = value.chunk(2, dim=0)
            value = torch.cat([shift, scale], dim=0)
        out[target] = value
    for target, parts in fused.items():
        if any(p is None for p in parts):
            raise KeyError(f"'{target}' lacks one of q, k, v.")
        out[target] = torch.cat(parts, dim=0)
    return out


def transformer_from_bfl(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BFL keys (with or without ``model.diffusion_model.``) -> diffusers keys, through diffusers' own converter."""
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    bare = {k.removeprefix(DIFFUSION_MODEL_PREFIX): v for k, v in state.items()}
    return convert_flux2_transformer_checkpoint_to_diffusers(bare)


def bfl_shape_facts(keys_and_shapes: dict[str, tuple[int, ...]]) -> dict[str, int | bool]:
    """What a BFL transformer file says about its architecture: widths, block counts, guidance embedding."""
    shapes = {k.removeprefix(DIFFUSION_MODEL_PREFIX): v for k, v in keys_and_shapes.items()}

    def count(prefix: str) -> int:
        return len({k.split(".")[1] for k in shapes if k.startswith(prefix + ".")})

    return {
        "hidden_size": shapes["img_in.weight"][0],
        "in_channels": shapes["img_in.weight"][1],
        "joint_attention_dim": shapes["txt_in.weight"][1],
        "num_layers": count("double_blocks"),
        "num_single_layers": count("single_blocks"),
        "guidance_embeds": "guidance_in.in_layer.weight" in shapes,
    }


def transformer_config_facts(config) -> dict[str, int | bool]:
    """The same facts from a Flux2Transformer2DModel config, to compare a file with a config tree."""
    return {
        "hidden_size": config["num_attention_heads"] * config["attention_head_dim"],
        "in_channels": config["in_channels"],
        "joint_attention_dim": config["joint_attention_dim"],
        "num_layers": config["num_layers"],
        "num_single_layers": config["num_single_layers"],
        "guidance_embeds": bool(config["guidance_embeds"]),
    }


# --------------------------------------------------------------------------- VAE
_VAE_BFL_RENAMES = (("quant_conv.", "encoder.quant_conv."), ("post_quant_conv.", "decoder.post_quant_conv."))


def vae_key_to_ldm(key: str, config) -> tuple[str, bool]:
    """(LDM key of one AutoencoderKLFlux2 parameter, whether the file stores it as a 1x1 conv)."""
    for ours, theirs in _VAE_BFL_RENAMES:
        if key.startswith(ours):
            return theirs + key[len(ours):], False
    return ldm_vae_key(key, config)


def vae_to_ldm(vae) -> dict[str, torch.Tensor]:
    """An AutoencoderKLFlux2 as the BFL / ComfyUI ``flux2-vae.safetensors`` stores it."""
    out = {}
    for key, value in vae.state_dict().items():
        ldm, conv = vae_key_to_ldm(key, vae.config)
        out[ldm] = value[:, :, None, None] if conv and value.ndim == 2 else value
    return out


def vae_from_ldm(state: dict[str, torch.Tensor], vae) -> dict[str, torch.Tensor]:
    """The diffusers state dict for `vae` (an AutoencoderKLFlux2 of the right config) from an LDM-layout file;
    SD-style ``quant_conv.`` names (no ``encoder.``) are read too. Raises KeyError naming the first missing key."""
    out = {}
    for key, like in vae.state_dict().items():
        ldm, conv = vae_key_to_ldm(key, vae.config)
        candidates = [ldm] + [ldm.replace(theirs, ours, 1) for ours, theirs in _VAE_BFL_RENAMES if
                              ldm.startswith(theirs)]
        found = next((c for c in candidates if c in state), None)
        if found is None:
            if key.endswith("num_batches_tracked"):
                continue  # a statistic of the batch norm's own training, not needed to use it
            raise KeyError(ldm)
        value = state[found]
        out[key] = value.reshape(like.shape) if conv else value
    return out

