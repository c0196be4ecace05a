"""The original (LDM, CompVis) layout of an AutoencoderKL's weights, the one single files store: SD's VAE under
``first_stage_model.``, FLUX.2's ``flux2-vae.safetensors`` (plus its quant convs and latent batch norm, which
models/flux2_klein/single_file.py adds). Tables read off diffusers' ``convert_*_checkpoint`` scripts; shared by the
families whose single files carry such a VAE, so no family folder imports another's.
"""
from __future__ import annotations


def rename_prefix(key: str, table: list[tuple[str, str]]) -> str:
    """`key` with the first diffusers prefix of `table` that starts it replaced by its original one."""
    for orig, diff in table:
        if key.startswith(diff):
            return orig + key[len(diff) :]
    return key


def vae_prefix_table(config) -> list[tuple[str, str]]:
    levels = len(config["block_out_channels"])
    lpb = config["layers_per_block"]
    table = [("encoder.norm_out.", "encoder.conv_norm_out."), ("decoder.norm_out.", "decoder.conv_norm_out.")]
    for part in ("encoder", "decoder"):
        table.append((f"{part}.mid.attn_1.", f"{part}.mid_block.attentions.0."))
        for j in range(2):
            table.append((f"{part}.mid.block_{j + 1}.", f"{part}.mid_block.resnets.{j}."))
    for i in range(levels):
        for j in range(lpb):
            table.append((f"encoder.down.{i}.block.{j}.", f"encoder.down_blocks.{i}.resnets.{j}."))
        for j in range(lpb + 1):
            table.append((f"decoder.up.{levels - 1 - i}.block.{j}.", f"decoder.up_blocks.{i}.resnets.{j}."))
        if i < levels - 1:
            table.append((f"encoder.down.{i}.downsample.", f"encoder.down_blocks.{i}.downsamplers.0."))
            table.append((f"decoder.up.{levels - 1 - i}.upsample.", f"decoder.up_blocks.{i}.upsamplers.0."))
    return table


VAE_ATTN = [
    ("norm.", "group_norm."),
    ("q.", "to_q."),
    ("k.", "to_k."),
    ("v.", "to_v."),
    ("proj_out.", "to_out.0."),
]


def ldm_vae_key(key: str, config) -> tuple[str, bool]:
    """(the LDM key of one diffusers VAE parameter, whether the original stores it as a 1x1 conv: the mid-block
    attention's q, k, v and proj_out, which diffusers keeps as Linear layers)."""
    new = rename_prefix(key, vae_prefix_table(config)).replace("conv_shortcut", "nin_shortcut")
    if "mid.attn_1." in new:
        head, tail = new.split("mid.attn_1.", 1)
        for orig, diff in VAE_ATTN:
            if tail.startswith(diff):
                return f"{head}mid.attn_1.{orig}{tail[len(diff):]}", not tail.startswith("group_norm.")
    return new, False
