"""`merge` and `extract` (issue 26.4) on the tiny SD1 and SDXL models and the toy base.

The reference is the LoRA applied at run time: our own peft injection (the model the file was exported from)
for LoRA, LoHa, LoKr and DoRA, and diffusers' `load_lora_weights` for the toy base. Tolerance: the merged
model's UNet and text-encoder outputs match within atol = rtol = 1e-4 (fp32 weights: the merged weight and
the run-time LoRA path differ only by rounding).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from stabletune_core.cli import main
from stabletune_core.lora.export import export_kohya_lora
from stabletune_core.lora.inject import is_adapter_parameter
from stabletune_core.models import get_family
from stabletune_core.models.sd import tiny
from tests.test_export_keys import bundle_with_lora
from tests.tools_helpers import read_only

TOL = dict(atol=1e-4, rtol=1e-4)
ATTENTION_AND_CONV = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "conv1"]
BUILD = {"sd1": (tiny.build_tiny_sd1, tiny.build_tiny_sd1_single_file),
         "sdxl": (tiny.build_tiny_sdxl, tiny.build_tiny_sdxl_single_file)}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Per family: the tiny model as a diffusers folder and as a single file (same weights, seed 0)."""
    root = tmp_path_factory.mktemp("bases")
    return {name: (folder(root / f"{name}-folder", seed=0), single(root / f"{name}.safetensors", seed=0))
            for name, (folder, single) in BUILD.items()}


def trained_lora(family: str, network_type: str, path: Path, seed: int, targets=ATTENTION_AND_CONV):
    """A bundle with a LoRA of random (non-zero) weights on UNet and text encoders, and its exported file."""
    bundle = bundle_with_lora(family, targets, True, network_type)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for model in (bundle.denoiser, *bundle.text_encoders):
            for name, p in model.named_parameters():
                if is_adapter_parameter(name):
                    p.copy_(p + 0.2 * torch.randn(p.shape, generator=gen))
    export_kohya_lora(path, bundle.denoiser, bundle.text_encoders, bundle.family, rank=2, alpha=2, dtype=torch.float32)
    return bundle, path


def outputs(bundle) -> list[torch.Tensor]:
    """The UNet's noise prediction and every text encoder's last hidden state on fixed inputs."""
    gen = torch.Generator().manual_seed(11)
    unet = bundle.denoiser
    latents, t = torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([17, 640])
    hidden = torch.randn(2, 77, unet.config.cross_attention_dim, generator=gen)
    extra = None
    if unet.config.addition_embed_type == "text_time":
        extra = {"text_embeds": torch.randn(2, 48, generator=gen), "time_ids": torch.randn(2, 6, generator=gen)}
    ids = torch.randint(0, 49408, (2, 77), generator=gen)
    with torch.no_grad():
        out = [unet(latents, t, hidden, added_cond_kwargs=extra).sample]
        out += [te(ids).last_hidden_state for te in bundle.text_encoders]
    return out


def load(family: str, path: Path, config_dir: Path):
    return get_family(family).load(str(path), config_dir=str(config_dir))


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("family,network_type", [("sd1", "lora"), ("sd1", "loha"), ("sd1", "lokr"), ("sd1", "dora"),
                                                 ("sdxl", "lora")])
def test_merged_single_file_matches_the_lora_at_run_time(family, network_type, bases, tmp_path, one_thread):
    folder, single = bases[family]
    bundle, lora = trained_lora(family, network_type, tmp_path / "style.safetensors", seed=1)
    before = hashlib.sha256(single.read_bytes()).hexdigest()
    merged = tmp_path / "merged.safetensors"
    assert main(["merge", "--model", str(single), "--model_config_dir", str(folder), "--lora", str(lora),
                 "--output", str(merged)]) == 0
    assert hashlib.sha256(single.read_bytes()).hexdigest() == before  # the input is untouched
    want, base = outputs(bundle), outputs(load(family, single, folder))
    got = outputs(load(family, merged, folder))
    for g, w, b in zip(got, want, base):
        assert (w - b).abs().max() > 1e-3  # the LoRA really changes every part
        torch.testing.assert_close(g, w, **TOL)
    # Only the tensors of adapted layers changed; everything else (VAE, norms, other layers) is bit-identical.
    old, new = tensors_of(single), tensors_of(merged)
    assert old.keys() == new.keys()
    changed = [k for k in old if not torch.equal(old[k], new[k])]
    assert changed and all(k.endswith("weight") for k in changed)
    assert not any(k.startswith("first_stage_model.") for k in changed)
    with safe_open(str(merged), "pt") as f:
        note = json.loads(f.metadata()["stabletune_merge"])
    assert note["loras"][0]["file"] == "style.safetensors" and note["loras"][0]["weight"] == 1.0


def test_merge_into_a_diffusers_folder_at_a_weight(bases, tmp_path, one_thread):
    folder, _ = bases["sd1"]
    bundle, lora = trained_lora("sd1", "lora", tmp_path / "style.safetensors", seed=2)
    out = tmp_path / "merged-folder"
    assert main(["merge", "--model", str(folder), "--lora", f"{lora}:0.5", "--output", str(out)]) == 0
    assert (out / "model_index.json").is_file() and (out / "stabletune_merge.json").is_file()
    base = outputs(load("sd1", folder, folder))
    full = outputs(bundle)
    got = outputs(get_family("sd1").load(str(out)))
    # at weight 0.5 every merged weight is base + 0.5 x dW (the outputs lie between, not on either end)
    merged_unet = get_family("sd1").load(str(out)).denoiser.state_dict()
    base_unet = load("sd1", folder, folder).denoiser.state_dict()
    key = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight"
    full_delta = bundle.denoiser.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q.get_delta_weight("default")
    torch.testing.assert_close(merged_unet[key], base_unet[key] + 0.5 * full_delta, **TOL)
    assert not torch.allclose(got[0], base[0], **TOL) and not torch.allclose(got[0], full[0], **TOL)


def test_merge_refusals(bases, tmp_path, capsys):
    folder, single = bases["sd1"]
    _, sdxl_lora = trained_lora("sdxl", "lora", tmp_path / "xl.safetensors", seed=3)
    out = tmp_path / "out.safetensors"
    assert main(["merge", "--model", str(single), "--model_config_dir", str(folder), "--lora", str(sdxl_lora),
                 "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("error: xl.safetensors is a Stable Diffusion XL LoRA and the model is Stable Diffusion 1.x; use a "
                   "LoRA made for this model's family.") and not out.exists()
    plain = {k: v for k, v in tensors_of(sdxl_lora).items()}
    save_file(plain, str(tmp_path / "no-meta.safetensors"))  # no metadata: the key names give it away
    assert main(["merge", "--model", str(single), "--model_config_dir", str(folder), "--lora",
                 str(tmp_path / "no-meta.safetensors"), "--output", str(out)]) == 2
    assert "is a Stable Diffusion XL LoRA" in capsys.readouterr().err
    assert main(["merge", "--model", str(tmp_path / "nope"), "--lora", str(sdxl_lora), "--output", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["merge", "--model", str(single), "--lora", str(sdxl_lora), "--output", str(single)]) == 2
    assert "already exists" in capsys.readouterr().err
    locked = tmp_path / "locked"
    locked.mkdir()
    with read_only(locked):
        assert main(["merge", "--model", str(single), "--lora", str(sdxl_lora), "--output",
                     str(locked / "m.safetensors")]) == 2
    assert "read-only" in capsys.readouterr().err
    _, loha = trained_lora("sd1", "loha", tmp_path / "loha.safetensors", seed=4)
    assert main(["merge", "--lora", str(loha), str(loha), "--output", str(tmp_path / "two.safetensors")]) == 2
    assert "loha.safetensors is a Loha file; merging LoRAs into one takes plain LoRA files" in capsys.readouterr().err


def deltas(path: Path) -> dict[str, torch.Tensor]:
    """Each module's update, alpha / rank x up @ down, conv flattened."""
    t = tensors_of(path)
    out = {}
    for key, down in t.items():
        if key.endswith(".lora_down.weight"):
            name = key[: -len(".lora_down.weight")]
            scale = float(t[f"{name}.alpha"]) / down.shape[0]
            out[name] = t[f"{name}.lora_up.weight"].double().flatten(1) @ down.double().flatten(1) * scale
    return out


def test_merge_several_loras_by_svd(tmp_path):
    _, a = trained_lora("sd1", "lora", tmp_path / "a.safetensors", seed=5)
    _, b = trained_lora("sd1", "lora", tmp_path / "b.safetensors", seed=6, targets=["to_q", "to_v", "conv1"])
    exact, lossy = tmp_path / "ab.safetensors", tmp_path / "ab-r1.safetensors"
    assert main(["merge", "--lora", f"{a}:0.7", f"{b}:0.3", "--rank", "4", "--output", str(exact),
                 "--save_precision", "fp32"]) == 0
    da, db, got = deltas(a), deltas(b), deltas(exact)
    assert set(got) == set(da) | set(db) and set(db) < set(da)
    for name in got:
        want = 0.7 * da[name] + 0.3 * db.get(name, torch.zeros_like(da[name]))
        torch.testing.assert_close(got[name], want, atol=1e-6, rtol=1e-5)  # rank 2 + 2 fits in 4: exact
    assert main(["merge", "--lora", f"{a}:0.7", f"{b}:0.3", "--rank", "1", "--output", str(lossy)]) == 0
    for name, d in deltas(lossy).items():
        want = 0.7 * da[name] + 0.3 * db.get(name, torch.zeros_like(da[name]))
        sv = torch.linalg.svdvals(want)
        error = float(torch.linalg.matrix_norm(d - want) ** 2)
        assert error == pytest.approx(float((sv[1:] ** 2).sum()), rel=2e-2, abs=1e-8)  # Eckart-Young, fp16 file
    with safe_open(str(exact), "pt") as f:
        meta = f.metadata()
    assert meta["ss_network_dim"] == "4" and meta["ss_network_alpha"] == "4.0" and meta["ss_output_name"] == "ab"
    assert "a.safetensors x0.7, b.safetensors x0.3" in meta["ss_training_comment"]
    assert meta["ss_base_model_version"] == "sd_v1"


def merge_then_extract(single: Path, folder: Path, lora: Path, tmp_path: Path) -> Path:
    """The LoRA merged into the single-file model, then extracted back at rank 4 (convolutions too), in fp32."""
    tuned = tmp_path / "tuned.safetensors"
    assert main(["merge", "--model", str(single), "--model_config_dir", str(folder), "--lora", str(lora),
                 "--output", str(tuned)]) == 0
    extracted = tmp_path / "extracted.safetensors"
    assert main(["extract", "--base", str(single), "--tuned", str(tuned), "--model_config_dir", str(folder),
                 "--rank", "4", "--conv_rank", "4", "--output", str(extracted), "--save_precision", "fp32"]) == 0
    return extracted


@pytest.mark.parametrize("family", ["sd1", "sdxl"])
def test_extract_recovers_the_lora_from_the_merged_checkpoint(family, bases, tmp_path, one_thread):
    folder, single = bases[family]
    bundle, lora = trained_lora(family, "lora", tmp_path / "style.safetensors", seed=7)
    extracted = merge_then_extract(single, folder, lora, tmp_path)
    tuned = tmp_path / "tuned.safetensors"  # the merged checkpoint merge_then_extract wrote
    want, got = deltas(lora), deltas(extracted)
    assert set(want) <= set(got)  # every trained layer is found (untrained ones are left out)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4)  # true rank 2 <= 4: exact
    again = tmp_path / "again.safetensors"
    assert main(["merge", "--model", str(single), "--model_config_dir", str(folder), "--lora", str(extracted),
                 "--output", str(again)]) == 0
    for g, w in zip(outputs(load(family, again, folder)), outputs(bundle)):
        torch.testing.assert_close(g, w, **TOL)
    with safe_open(str(extracted), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["stabletune_extract"])["tuned"] == "tuned.safetensors"
    energy = tmp_path / "energy.safetensors"
    assert main(["extract", "--base", str(single), "--tuned", str(tuned), "--model_config_dir", str(folder),
                 "--energy", "0.999", "--output", str(energy)]) == 0
    assert {t.shape[0] for k, t in tensors_of(energy).items() if k.endswith("lora_down.weight")} <= {1, 2}


def test_extract_refuses_identical_or_mismatched_checkpoints(bases, tmp_path, capsys):
    folder, single = bases["sd1"]
    out = tmp_path / "x.safetensors"
    assert main(["extract", "--base", str(single), "--tuned", str(single), "--model_config_dir", str(folder),
                 "--output", str(out)]) == 2
    assert "do not differ" in capsys.readouterr().err and not out.exists()
    assert main(["extract", "--base", str(single), "--tuned", str(bases["sdxl"][1]), "--output", str(out)]) == 2
    assert "different model families" in capsys.readouterr().err


def test_toy_base_merge_matches_diffusers_load_lora_weights(toy_base, tmp_path, one_thread):
    """One realistic check: a LoRA on the pretrained toy base, baked into a diffusers folder, gives the UNet and
    text encoder outputs of diffusers' own run-time LoRA."""
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig

    family = get_family("sd1")
    bundle = family.load(str(toy_base))
    bundle.denoiser.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=ATTENTION_AND_CONV,
                                       init_lora_weights="gaussian"))
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, p in bundle.denoiser.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    lora = tmp_path / "toy.safetensors"
    export_kohya_lora(lora, bundle.denoiser, None, family, rank=4, alpha=4, dtype=torch.float32)
    out = tmp_path / "toy-merged"
    assert main(["merge", "--model", str(toy_base), "--lora", str(lora), "--output", str(out),
                 "--save_precision", "fp32"]) == 0
    pipe = StableDiffusionPipeline.from_pretrained(str(toy_base), local_files_only=True, safety_checker=None)
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    runtime = type(bundle)(family=family, denoiser=pipe.unet, vae=pipe.vae, text_encoders=[pipe.text_encoder],
                           tokenizers=[], noise_scheduler=None, source="")
    for g, w in zip(outputs(family.load(str(out))), outputs(runtime)):
        torch.testing.assert_close(g, w, **TOL)
