"""Issue 39 item 3 (LoKr, DoRA, LoHa on Z-Image): where each adapter kind's Z-Image file loads, declared once
(config/hosts.py Z_IMAGE_SUPPORT), proven here and in the README.

For every kind StableTune trains, the file we write is loaded by diffusers' real ZImagePipeline.load_lora_weights
(installed): where the table says diffusers loads it, the loaded transformer computes what the trained one does
(1e-5); where it says not, that is true (refused, or another model). ComfyUI: every key of every kind is one that its
Lumina2 key map matches (tests/test_z_image.py comfy_z_image_key_map, read from comfy/lora.py and comfy/utils.py)
with a tensor name its weight adapters read, and each q / k / v delta fills exactly its slice of the fused qkv.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from test_z_image import comfy_z_image_key_map, folders, output  # noqa: F401 (the module-scoped tiny model)
from test_z_image_adapter import adapted_z_image
from stabletune_core.config.hosts import Z_IMAGE_SUPPORT, run_host_limits
from stabletune_core.lora.export import export_kohya_lora
from stabletune_core.models.z_image.family import LORA_PRESETS

TOLERANCE = 1e-5
README = Path(__file__).resolve().parent.parent / "README.md"
#: The tensor names ComfyUI's weight adapters read under a mapped key (comfy/weight_adapter: lora.py with DoRA's
#: dora_scale, loha.py, lokr.py).
COMFY_TENSORS = {"lora": ("lora_up.weight", "lora_down.weight", "alpha", "dora_scale"),
                 "loha": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"),
                 "lokr": ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b", "alpha")}


def written(folder: Path, kind: str, tmp_path: Path):
    bundle = adapted_z_image(folder, LORA_PRESETS["attention_mlp"], network=kind)
    file = export_kohya_lora(tmp_path / f"{kind}.safetensors", bundle.denoiser, None, bundle.family, rank=4, alpha=2.0,
                             dtype=torch.float32)
    return bundle, file


def diffusers_computes_ours(folder: Path, bundle, file: Path) -> bool:
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(str(folder), local_files_only=True)
    try:
        pipe.load_lora_weights(str(file))
    except (ValueError, KeyError, RuntimeError):  # "Invalid adapter checkpoint", keys left over
        return False
    return float((output(bundle.denoiser) - output(pipe.transformer)).abs().max()) <= TOLERANCE


def rows_of_the_delta(tensors: dict[str, torch.Tensor], module: str) -> int:
    """How many output rows the module's delta has (what ComfyUI's narrowed slice must be)."""
    if f"{module}.lora_up.weight" in tensors:
        return tensors[f"{module}.lora_up.weight"].shape[0]
    if f"{module}.hada_w1_a" in tensors:
        return tensors[f"{module}.hada_w1_a"].shape[0]
    w1 = tensors.get(f"{module}.lokr_w1", tensors.get(f"{module}.lokr_w1_a"))
    w2 = tensors.get(f"{module}.lokr_w2", tensors.get(f"{module}.lokr_w2_a"))
    return w1.shape[0] * w2.shape[0]


def comfyui_matches_every_key(folder: Path, file: Path) -> bool:
    from diffusers import ZImageTransformer2DModel

    config = ZImageTransformer2DModel.load_config(str(folder / "transformer"))
    key_map = comfy_z_image_key_map(config["n_layers"], config["dim"], config["n_refiner_layers"])
    tensors = load_file(str(file))
    suffixes = [s for names in COMFY_TENSORS.values() for s in names]
    matched = set()
    for module, target in key_map.items():
        found = {f"{module}.{s}" for s in suffixes if f"{module}.{s}" in tensors}
        if not found:
            continue
        matched |= found
        if isinstance(target, tuple) and rows_of_the_delta(tensors, module) != target[1][2]:
            return False  # the delta would not fill its q / k / v slice
    return matched == set(tensors)


def declared_loads(kind: str, host: str) -> bool:
    return Z_IMAGE_SUPPORT[kind][next(h for h in Z_IMAGE_SUPPORT[kind] if h.startswith(host))] is None


@pytest.mark.parametrize("kind", ["lora", "dora", "loha", "lokr"])
def test_each_kind_loads_where_the_table_says_and_only_there(kind, folders, tmp_path, one_thread):
    from diffusers import ZImagePipeline

    bundle, file = written(folders["base"], kind, tmp_path)
    base = ZImagePipeline.from_pretrained(str(folders["base"]), local_files_only=True).transformer
    assert (output(bundle.denoiser) - output(base)).abs().max() > 100 * TOLERANCE  # the adapter acts
    assert diffusers_computes_ours(folders["base"], bundle, file) == declared_loads(kind, "diffusers"), kind
    assert comfyui_matches_every_key(folders["base"], file) == declared_loads(kind, "ComfyUI"), kind


def readme_z_image_rows() -> dict[str, dict[str, str]]:
    lines = [line for line in README.read_text().splitlines() if line.strip().startswith("|")]
    header = next([cell.strip() for cell in line.split("|")] for line in lines if line.split("|")[1].strip() == "LoRA of")
    rows = {}
    for line in lines:
        cells = [cell.strip() for cell in line.split("|")]
        if cells[1].startswith("Z-Image"):
            rows[re.search(r"\b(LoRA|DoRA|LoHa|LoKr)\b", cells[1])[1].lower()] = dict(zip(header, cells))
    return rows


def test_the_readme_host_table_says_what_the_table_says():
    rows = readme_z_image_rows()
    assert set(rows) == set(Z_IMAGE_SUPPORT), rows.keys()
    for kind, support in Z_IMAGE_SUPPORT.items():
        for host, reason in support.items():
            column = next(c for c in rows[kind] if c.startswith(host.split()[0]))
            assert rows[kind][column].startswith("yes" if reason is None else "no"), (kind, host)


def test_the_limits_reach_the_console_before_start():
    from stabletune_core.config import build_config

    notes = build_config(dict(model_family="z_image", use_dora=True)).notes()
    assert any(n.startswith("This DoRA file does not load in diffusers") and "0.42.1" in n for n in notes), notes
    assert not [n for n in build_config(dict(model_family="z_image", network_type="lokr")).notes()
                if "does not load" in n]
    assert run_host_limits(build_config(dict(model_family="z_image", network_type="loha")), "z_image")


def test_our_z_image_lora_merges_into_the_z_image_folder_as_trained(folders, tmp_path, one_thread, capsys):
    """`merge` reads the kohya names the family declares (kohya_denoiser_name: diffusion_model. + the path), not a
    naming literal: at 22f601e it refused our own Z-Image file ("modules this Z-Image model lacks")."""
    from stabletune_core.cli import main
    from stabletune_core.models import get_family

    bundle, file = written(folders["base"], "lora", tmp_path)
    assert main(["merge", "--model", str(folders["base"]), "--lora", str(file), "--output", str(tmp_path / "m")]) == 0
    assert "diffusers folder" in capsys.readouterr().out
    base = output(get_family("z_image").load(str(folders["base"])).denoiser)
    ours = output(bundle.denoiser)
    assert (ours - base).abs().max() > 50 * TOLERANCE  # the LoRA does change the model
    assert (output(get_family("z_image").load(str(tmp_path / "m")).denoiser) - ours).abs().max() <= TOLERANCE
