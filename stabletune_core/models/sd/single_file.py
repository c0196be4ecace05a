"""diffusers -> original (CompVis / A1111) Stable Diffusion 1.x checkpoint keys.

A compact, layout-general port of diffusers'
``scripts/convert_diffusers_to_original_stable_diffusion.py``: the tables are
built from the models' configs (levels, layers per block, which levels have
attention) rather than hard-coded for SD1.5's 4 x 2 layout, so the tiny test
model converts exactly like the real one. Used for tests and the demo export;
training never needs it.
"""
from __future__ import annotations

import torch

from ..ldm_vae import ldm_vae_key, rename_prefix

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
TEXT_ENCODER_PREFIX = "cond_stage_model.transformer."

_UNET_TOP = [
    # (original, diffusers)
    ("time_embed.0.", "time_embedding.linear_1."),
    ("time_embed.2.", "time_embedding.linear_2."),
    ("input_blocks.0.0.", "conv_in."),
    ("out.0.", "conv_norm_out."),
    ("out.2.", "conv_out."),
    ("label_emb.0.0.", "add_embedding.linear_1."),  # SDXL's size + pooled-text embedding
    ("label_emb.0.2.", "add_embedding.linear_2."),
]
_UNET_RESNET = [
    ("in_layers.0", "norm1"),
    ("in_layers.2", "conv1"),
    ("out_layers.0", "norm2"),
    ("out_layers.3", "conv2"),
    ("emb_layers.1", "time_emb_proj"),
    ("skip_connection", "conv_shortcut"),
]


def _unet_prefix_table(config) -> list[tuple[str, str]]:
    """(original prefix, diffusers prefix) pairs for a UNet2DConditionModel config."""
    levels = len(config["block_out_channels"])
    lpb = config["layers_per_block"]
    if not isinstance(lpb, int):
        raise ValueError("Per-level layers_per_block is not supported by the SD checkpoint layout.")
    n = lpb + 1  # input blocks per level (resnets + downsampler); output blocks per level
    down_attn = ["CrossAttn" in t for t in config["down_block_types"]]
    up_attn = ["CrossAttn" in t for t in config["up_block_types"]]
    table = list(_UNET_TOP)
    for i in range(levels):
        for j in range(lpb):
            table.append((f"input_blocks.{n * i + j + 1}.0.", f"down_blocks.{i}.resnets.{j}."))
            if down_attn[i]:
                table.append((f"input_blocks.{n * i + j + 1}.1.", f"down_blocks.{i}.attentions.{j}."))
        for j in range(n):
            table.append((f"output_blocks.{n * i + j}.0.", f"up_blocks.{i}.resnets.{j}."))
            if up_attn[i]:
                table.append((f"output_blocks.{n * i + j}.1.", f"up_blocks.{i}.attentions.{j}."))
        if i < levels - 1:
            table.append((f"input_blocks.{n * (i + 1)}.0.op.", f"down_blocks.{i}.downsamplers.0.conv."))
            table.append((f"output_blocks.{n * i + n - 1}.{2 if up_attn[i] else 1}.", f"up_blocks.{i}.upsamplers.0."))
    table.append(("middle_block.1.", "mid_block.attentions.0."))
    table.append(("middle_block.0.", "mid_block.resnets.0."))
    table.append(("middle_block.2.", "mid_block.resnets.1."))
    return table


def _original_unet_key(key: str, table: list[tuple[str, str]]) -> str:
    """One diffusers UNet key (a weight or a module path) in the original layout, ResNet insides included."""
    new = rename_prefix(key, table)
    if "resnets" in key:
        for orig, diff in _UNET_RESNET:
            new = new.replace(diff, orig)
    return new


def convert_unet_state_dict(unet) -> dict[str, torch.Tensor]:
    table = _unet_prefix_table(unet.config)
    return {UNET_PREFIX + _original_unet_key(key, table): value for key, value in unet.state_dict().items()}


def convert_vae_state_dict(vae) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in vae.state_dict().items():
        new, conv = ldm_vae_key(key, vae.config)
        if conv and value.ndim == 2:  # the original model uses 1x1 convolutions for q, k, v, proj_out
            value = value[:, :, None, None]
        out[VAE_PREFIX + new] = value
    return out


def convert_text_encoder_state_dict(text_encoder) -> dict[str, torch.Tensor]:
    """Always ``cond_stage_model.transformer.text_model.*``, whatever the transformers version calls it."""
    out = {}
    for key, value in text_encoder.state_dict().items():
        if key.endswith("position_ids"):
            continue
        if not key.startswith("text_model."):
            key = "text_model." + key
        out[TEXT_ENCODER_PREFIX + key] = value
    return out


def diffusers_to_original_sd(unet, vae, text_encoder) -> dict[str, torch.Tensor]:
    """One state dict with SD1's original checkpoint keys (what A1111/ComfyUI single files contain)."""
    state = {}
    state.update(convert_unet_state_dict(unet))
    state.update(convert_vae_state_dict(vae))
    state.update(convert_text_encoder_state_dict(text_encoder))
    return {k: v.detach().clone().contiguous() for k, v in state.items()}


# --------------------------------------------------------------------------- SD 2.x / SDXL
OPEN_CLIP_PREFIX_SD2 = "cond_stage_model.model."
SDXL_TEXT_ENCODER_PREFIX = "conditioner.embedders.0.transformer."
OPEN_CLIP_PREFIX_SDXL = "conditioner.embedders.1.model."

_OPEN_CLIP_LAYER = [
    # (original, transformers) inside one residual block
    ("ln_1.", "layer_norm1."),
    ("ln_2.", "layer_norm2."),
    ("attn.out_proj.", "self_attn.out_proj."),
    ("mlp.c_fc.", "mlp.fc1."),
    ("mlp.c_proj.", "mlp.fc2."),
]


def convert_open_clip_text_encoder(text_encoder, prefix: str) -> dict[str, torch.Tensor]:
    """A transformers CLIP text model -> OpenCLIP keys (what SD2 and SDXL's second encoder ship as).

    q/k/v are fused into ``attn.in_proj_*`` and ``text_projection`` is stored transposed, as open_clip does.
    """
    state = {k.removeprefix("text_model."): v for k, v in text_encoder.state_dict().items()
             if not k.endswith("position_ids")}
    out = {
        prefix + "token_embedding.weight": state["embeddings.token_embedding.weight"],
        prefix + "positional_embedding": state["embeddings.position_embedding.weight"],
        prefix + "ln_final.weight": state["final_layer_norm.weight"],
        prefix + "ln_final.bias": state["final_layer_norm.bias"],
    }
    if "text_projection.weight" in state:
        out[prefix + "text_projection"] = state["text_projection.weight"].T
    for i in range(text_encoder.config.num_hidden_layers):
        src, dst = f"encoder.layers.{i}.", f"{prefix}transformer.resblocks.{i}."
        for kind in ("weight", "bias"):
            out[f"{dst}attn.in_proj_{kind}"] = torch.cat(
                [state[f"{src}self_attn.{p}_proj.{kind}"] for p in ("q", "k", "v")])
            for orig, ours in _OPEN_CLIP_LAYER:
                out[f"{dst}{orig}{kind}"] = state[f"{src}{ours}{kind}"]
    return out


def diffusers_to_original_sd2(unet, vae, text_encoder) -> dict[str, torch.Tensor]:
    """SD 2.x checkpoint keys: the SD1 UNet/VAE layout plus an OpenCLIP text encoder."""
    state = {}
    state.update(convert_unet_state_dict(unet))
    state.update(convert_vae_state_dict(vae))
    state.update(convert_open_clip_text_encoder(text_encoder, OPEN_CLIP_PREFIX_SD2))
    return {k: v.detach().clone().contiguous() for k, v in state.items()}


def diffusers_to_original_sdxl(unet, vae, text_encoder, text_encoder_2) -> dict[str, torch.Tensor]:
    """SDXL (SGM) checkpoint keys: CLIP-L under conditioner.embedders.0, OpenCLIP-G under embedders.1."""
    state = {}
    state.update(convert_unet_state_dict(unet))
    state.update(convert_vae_state_dict(vae))
    for key, value in convert_text_encoder_state_dict(text_encoder).items():
        state[SDXL_TEXT_ENCODER_PREFIX + key.removeprefix(TEXT_ENCODER_PREFIX)] = value
    state.update(convert_open_clip_text_encoder(text_encoder_2, OPEN_CLIP_PREFIX_SDXL))
    return {k: v.detach().clone().contiguous() for k, v in state.items()}


def sgm_unet_module_path(module_path: str, unet_config) -> str:
    """A diffusers UNet module path in the original (SGM / CompVis) layout, e.g.
    ``down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`` -> ``input_blocks.4.1.transformer_blocks.0.attn1.to_q``
    for SDXL, and ``down_blocks.1.resnets.0.conv1`` -> ``input_blocks.4.0.in_layers.2`` (the ResNet insides are
    renamed too, exactly as in the checkpoint). This is how kohya names SDXL LoRA modules."""
    return _original_unet_key(module_path + ".", _unet_prefix_table(unet_config))[:-1]


def kohya_sgm_unet_name(module_path: str, unet_config) -> str:
    """SDXL: the module under its original SGM name, as kohya's sd-scripts write SDXL LoRAs:
    ``down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`` -> ``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q``."""
    from ...lora.names import kohya_unet_name

    return kohya_unet_name(sgm_unet_module_path(module_path, unet_config))
