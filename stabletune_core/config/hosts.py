"""Which host programs load which kind of FLUX.2 Klein and Z-Image adapter file, declared once.

The README's host table is checked against this (tests/test_flux2_hosts.py reads both), and the same tests load every
kind with diffusers' real loader and with ComfyUI's rules (re-stated in tests/test_flux2_lora.py) and assert that each
"loads" here computes what was trained and each limit here is real. The UI (before Start), the console (a note before
training and at the end of the run) say the limits of the run's kind from `klein_host_limits`.

The file is the kohya-style one StableTune writes (models/flux2_klein/lora.py): LoRA under BFL module names, DoRA / LoHa under
diffusers module paths in LyCORIS naming, LoKr as transformer.<diffusers path> with alpha folded in (a magnitude or a
Hadamard / Kronecker product cannot be fused onto BFL's q/k/v weight exactly). A LoKr used to be LyCORIS-named too,
which diffusers 0.42.1 refuses whole when it adapts x_embedder, context_embedder or proj_out.

A Z-Image file (models/z_image/family.py kohya_denoiser_name: ``diffusion_model.`` + diffusers' module path for every
kind, ai-toolkit's names) is read by ComfyUI through one key map for every kind (its Lumina2 branch; q/k/v as slices
of the fused qkv, which comfy/lora.py narrows before any adapter computes, so LoHa / LoKr / DoRA deltas land on the
slice exactly); diffusers' ZImageLoraLoaderMixin reads LoRA and LoKr (tests/test_z_image_hosts.py proves both lists).
"""
from __future__ import annotations

from typing import Any

from ..family_files import KLEIN, Z_IMAGE, is_flux2_klein

HOSTS = ("ComfyUI", "diffusers 0.42")
#: The Klein modules outside the blocks that a DoRA / LoHa / LoKr file can adapt (models/flux2_klein/lora.py LYCORIS_TOP_LEVEL).
TOP_LEVEL = ("x_embedder", "context_embedder", "proj_out")

#: {kind: {host: None (loads) or what stops it, ending in the host version that first loads it}}.
KLEIN_SUPPORT: dict[str, dict[str, str | None]] = {
    "lora": {"ComfyUI": None, "diffusers 0.42": None},
    "dora": {"ComfyUI": None,
             "diffusers 0.42": "diffusers 0.42.1 drops dora_scale and loads no layer of a FLUX.2 DoRA (no diffusers "
                               "release loads one yet)"},
    "loha": {"ComfyUI": None,
             "diffusers 0.42": "diffusers 0.42.1 refuses a FLUX.2 LoHa file (no diffusers release loads one yet)"},
    "lokr": {"ComfyUI": None, "diffusers 0.42": None},
}
#: ComfyUI maps a LyCORIS-named (DoRA / LoHa) or ``transformer.<path>`` (LoKr) Klein file through its
#: comfy/utils.py flux_to_diffusers table (read at Comfy-Org/ComfyUI b3be02d6e766, comfy/lora.py at ec93dcacb96b).
#: FLUX.1's double-block attention names were always there; FLUX.2's single blocks (attn.to_qkv_mlp_proj,
#: attn.to_out) came with PR #11981 (2026-01-20; issue #11926 shows them missing on 2026-01-17) and the double
#: blocks' MLP layers (ff.linear_in / ff.linear_out, ff_context.*) with PR #11997 (opened 2026-01-21; on 2026-01-26,
#: issue #12084, it was still applied by hand). The merge commits and the first release with each could not be
#: established: the index keeps single versions of those files, not their history, and the repository (1.2 GB) is
#: over the fetch limit. Older builds skip the layers they cannot map with a 'lora key not loaded' warning.
#: A plain Klein LoRA (BFL names, ``lora_unet_``) maps in every ComfyUI that runs FLUX.2.
COMFYUI_LYCORIS_SINCE = ("builds with PR #11997 (opened 2026-01-21) load every layer of it; older ones skip its MLP "
                         "layers, and builds before PR #11981 (2026-01-20) its single blocks too")


#: {kind: {host: None (loads) or what stops it}} for Z-Image.
Z_IMAGE_SUPPORT: dict[str, dict[str, str | None]] = {
    "lora": {"ComfyUI": None, "diffusers 0.42": None},
    "dora": {"ComfyUI": None,
             "diffusers 0.42": "diffusers 0.42.1 drops dora_scale and loads the rest as a plain LoRA, another model "
                               "than the one trained (no diffusers release loads a Z-Image DoRA yet)"},
    "loha": {"ComfyUI": None,
             "diffusers 0.42": "diffusers 0.42.1 refuses a Z-Image LoHa file (no diffusers release loads one yet)"},
    "lokr": {"ComfyUI": None, "diffusers 0.42": None},
}
#: The families with a table above; the SD families' row in the README has no limits by kind.
SUPPORT_BY_FAMILY = {KLEIN: KLEIN_SUPPORT, Z_IMAGE: Z_IMAGE_SUPPORT}


def adapter_kind(network_type: str, use_dora: bool) -> str:
    """'lora', 'dora', 'loha' or 'lokr': the kind of adapter file a run writes."""
    return "dora" if use_dora and network_type == "lora" else network_type


def host_limits(support: dict[str, dict[str, str | None]], kind: str) -> list[str]:
    """Where a file of `kind` does not load according to `support` (one family's table), one sentence each."""
    return [f"This {kind_words(kind)} file does not load in {host.split()[0]}: {reason}."
            for host, reason in support[kind].items() if reason is not None]


def klein_host_limits(kind: str) -> list[str]:
    """Where a FLUX.2 Klein file of `kind` does not load (or loads only from some version), one sentence each."""
    limits = host_limits(KLEIN_SUPPORT, kind)
    if kind != "lora":
        limits.append(f"This {kind_words(kind)} file loads in ComfyUI: {COMFYUI_LYCORIS_SINCE}.")
    return limits


def kind_words(kind: str) -> str:
    return {"lora": "LoRA", "dora": "DoRA", "loha": "LoHa", "lokr": "LoKr"}[kind]


def run_host_limits(config: Any, family: str) -> list[str]:
    """The host limits of a run's config (nothing for the SD families: their table row has no limits by kind
    beyond what the README says)."""
    kind = adapter_kind(config.network_type, config.use_dora)
    if is_flux2_klein(family):
        return klein_host_limits(kind)
    return host_limits(SUPPORT_BY_FAMILY[family], kind) if family in SUPPORT_BY_FAMILY else []
