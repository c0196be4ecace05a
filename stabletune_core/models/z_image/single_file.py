"""Z-Image's original checkpoint layout, the one of the single files users download.

ComfyUI keeps Z-Image as ``models/diffusion_models/z_image_turbo_bf16.safetensors`` (or the Base file): the
transformer alone, in Tongyi-MAI's own key names, which ComfyUI's Lumina2 ``NextDiT`` reads (comfy/model_detection.py
``detect_unet_config``: ``cap_embedder.1.weight`` makes it Lumina2, a width of 3840 Z-Image; its blocks carry
``adaLN_modulation.0``, where Lumina 2's carry ``adaLN_modulation.1``). A full checkpoint puts the same keys under
``model.diffusion_model.``. Where the original and diffusers' ZImageTransformer2DModel differ (read off diffusers
0.42.1 ``convert_z_image_transformer_checkpoint_to_diffusers``; the table below is ours):

* attention: one fused ``attention.qkv`` (q, k, v stacked on rows) <-> ``attention.to_q`` / ``to_k`` / ``to_v``;
  ``attention.out`` <-> ``attention.to_out.0``; ``attention.q_norm`` / ``k_norm`` <-> ``norm_q`` / ``norm_k``;
* the patch embedder and final layer: ``x_embedder.`` / ``final_layer.`` <-> ``all_x_embedder.2-1.`` /
  ``all_final_layer.2-1.`` (diffusers keys them by patch size 2 and frame patch size 1);
* ``norm_final.weight``, which some original files carry and neither model computes with, is dropped on reading.

Every other key (the refiners, ``t_embedder``, ``cap_embedder``, the feed-forward, the norms, the pad tokens) has
the same name in both.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from ...family_files import ALL_IN_ONE_PREFIX, Z_IMAGE_FUSED_QKV, z_image_file_layout
from ..base import ModelLoadError

FULL_CHECKPOINT_PREFIX = ALL_IN_ONE_PREFIX
#: (original name part, diffusers name part), applied to whole dotted segments.
_RENAMES = (
    (".x_embedder.", ".all_x_embedder.2-1."),
    (".final_layer.", ".all_final_layer.2-1."),
    (".attention.out.", ".attention.to_out.0."),
    (".attention.q_norm.", ".attention.norm_q."),
    (".attention.k_norm.", ".attention.norm_k."),
)
_UNUSED = ("norm_final.weight",)
_SPLIT = re.compile(r"(.+\.attention)\.to_([qkv])\.(weight|bias)")
#: The file rule (which layout, or none) is family_files.py's, the one the UI reads without torch.
file_layout = z_image_file_layout


def _rename(key: str, to_diffusers: bool) -> str:
    out = "." + key  # every name part starts with a dot, so a part matches only whole segments
    for original, diffusers in _RENAMES:
        out = out.replace(original, diffusers) if to_diffusers else out.replace(diffusers, original)
    return out[1:]


def transformer_from_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Original keys (with or without ``model.diffusion_model.``) -> ZImageTransformer2DModel keys: the fused qkv
    split in three equal row blocks (Z-Image has as many key / value heads as query heads)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        key = key.removeprefix(FULL_CHECKPOINT_PREFIX)
        if key in _UNUSED:
            continue
        fused = Z_IMAGE_FUSED_QKV.fullmatch(key)
        if fused:
            for part, chunk in zip("qkv", value.chunk(3, dim=0)):
                out[f"{fused[1]}.to_{part}.{fused[2]}"] = chunk
            continue
        out[_rename(key, to_diffusers=True)] = value
    return out


def transformer_to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ZImageTransformer2DModel keys -> the original layout ComfyUI loads (no prefix, as in its diffusion_models
    folder). Raises KeyError when an attention lacks one of q, k, v."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        split = _SPLIT.fullmatch(key)
        if split:
            parts.setdefault(f"{split[1]}.qkv.{split[3]}", {})[split[2]] = value
            continue
        out[_rename(key, to_diffusers=False)] = value
    for target, found in parts.items():
        if set(found) != set("qkv"):
            raise KeyError(f"'{target}' lacks one of q, k, v.")
        out[_rename(target, to_diffusers=False)] = torch.cat([found[p] for p in "qkv"], dim=0).contiguous()
    return out


def shape_facts(keys_and_shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """What an original-layout file says about its architecture (comfy/model_detection.py reads the same)."""
    shapes = {k.removeprefix(FULL_CHECKPOINT_PREFIX): v for k, v in keys_and_shapes.items()}

    def count(prefix: str) -> int:
        return len({k.split(".")[1] for k in shapes if k.startswith(prefix + ".")})

    dim, cap_feat_dim = shapes["cap_embedder.1.weight"]
    head_dim = shapes["layers.0.attention.q_norm.weight"][0]
    return {"dim": dim, "cap_feat_dim": cap_feat_dim, "n_layers": count("layers"),
            "n_refiner_layers": count("noise_refiner"), "n_heads": dim // head_dim,
            "patch_features": shapes["x_embedder.weight"][1]}


def config_facts(config) -> dict[str, int]:
    """The same facts from a ZImageTransformer2DModel config."""
    patch = config["all_patch_size"][0] ** 2 * config["all_f_patch_size"][0]
    return {"dim": config["dim"], "cap_feat_dim": config["cap_feat_dim"], "n_layers": config["n_layers"],
            "n_refiner_layers": config["n_refiner_layers"], "n_heads": config["n_heads"],
            "patch_features": config["in_channels"] * patch}


# --------------------------------------------------------------------------- reading one file
def check_transformer_file(path: Path) -> dict[str, tuple[int, ...]]:
    """The file's keys and shapes (its header only), or ModelLoadError in one sentence when it is no Z-Image
    transformer."""
    from ..sources import safetensors_header

    shapes, _ = safetensors_header(path)
    if file_layout(shapes) == "other":
        raise ModelLoadError(f"'{path.name}' is not a Z-Image transformer (it lacks cap_embedder.1.weight and "
                             "layers.0.adaLN_modulation.0.weight); point at z_image_turbo_bf16.safetensors, the Base "
                             "file, or a Z-Image diffusers folder.")
    return shapes


def load_transformer_file(path: Path, shapes: dict[str, tuple[int, ...]], config_folder: Path,
                          torch_dtype: torch.dtype):
    """A ZImageTransformer2DModel of `config_folder`'s config (a Z-Image diffusers folder's transformer/) with the
    weights of the file at `path`; one sentence (ModelLoadError) when they do not fit, before any weight is read."""
    from accelerate import init_empty_weights
    from diffusers import ZImageTransformer2DModel
    from safetensors.torch import load_file

    config = ZImageTransformer2DModel.load_config(str(config_folder))
    original = file_layout(shapes) == "original"
    if original and shape_facts(shapes) != config_facts(config):
        raise ModelLoadError(f"'{path.name}' does not fit the transformer config in '{config_folder.parent}' (file: "
                             f"{shape_facts(shapes)}, config: {config_facts(config)}); use the folder of the same "
                             "Z-Image.")
    state = load_file(str(path))
    state = transformer_from_original(state) if original else state
    with init_empty_weights():
        transformer = ZImageTransformer2DModel.from_config(config)
    expected = transformer.state_dict()
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [k for k in expected if k in state and tuple(state[k].shape) != tuple(expected[k].shape)]
    if missing or extra or wrong:
        problem = (f"lacks '{missing[0]}'" if missing else f"has '{extra[0]}', which the config does not"
                   if extra else f"stores '{wrong[0]}' as {tuple(state[wrong[0]].shape)}")
        raise ModelLoadError(f"'{path.name}' does not fit the transformer config in '{config_folder.parent}': it "
                             f"{problem}.")
    transformer.load_state_dict({k: v.to(torch_dtype) for k, v in state.items()}, strict=True, assign=True)
    return transformer
