"""`resize`: SVD rank reduction of kohya LoRA files (linear and conv modules), and the rank suggestion."""
from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig
from safetensors import safe_open

from stabletune_core.lora.export import REQUIRED_METADATA_KEYS, compute_sshs_hash, export_kohya_lora
from stabletune_core.lora.resize import resize_file, suggest_rank
from stabletune_core.lora.svd import spectra
from stabletune_core.models.sd.sd1 import SD1

RANK, ALPHA, TRUE_RANK = 8, 4.0, 3
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "conv1"]  # proj_in is a 1x1 conv, conv1 a 3x3 one


@pytest.fixture(scope="module")
def lora_file(tiny_model, tmp_path_factory):
    """A rank-8 LoRA on the tiny SD1 UNet (attention, 1x1 and 3x3 convs) whose every update has rank 3:
    lora_up = C @ D with C (out x 3), so up @ down = C @ (D @ down) has rank exactly 3 in general position."""
    family = SD1()
    bundle = family.load(str(tiny_model))
    bundle.denoiser.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, init_lora_weights="gaussian"))
    gen = torch.Generator().manual_seed(5)
    convs = 0
    with torch.no_grad():
        for name, p in bundle.denoiser.named_parameters():
            if "lora_B" in name:
                out = p.shape[0]
                low = torch.randn(out, TRUE_RANK, generator=gen) @ torch.randn(TRUE_RANK, RANK, generator=gen)
                p.copy_((0.1 * low).reshape(p.shape))
                convs += p.ndim == 4
    assert convs >= 2  # conv modules really are in the file
    path = tmp_path_factory.mktemp("resize") / "style.safetensors"
    export_kohya_lora(path, bundle.denoiser, None, family, rank=RANK, alpha=ALPHA, dtype=torch.float32,
                      metadata={"ss_training_comment": "made for the test"})
    return path


def _read(path):
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())


def _deltas(tensors):
    """Merged update per module, W = up @ down * alpha / rank, as A1111 applies it (conv flattened)."""
    out = {}
    for key, down in tensors.items():
        if key.endswith(".lora_down.weight"):
            name = key[: -len(".lora_down.weight")]
            up = tensors[f"{name}.lora_up.weight"]
            scale = float(tensors[f"{name}.alpha"]) / down.shape[0]
            out[name] = up.reshape(up.shape[0], -1).double() @ down.reshape(down.shape[0], -1).double() * scale
    return out


def _kohya_checks(path, rank):
    tensors, meta = _read(path)
    for key, value in tensors.items():
        assert key.startswith("lora_unet_"), key
        assert key.endswith((".lora_down.weight", ".lora_up.weight", ".alpha")), key
        if key.endswith(".alpha"):
            assert value.ndim == 0 and value.dtype == torch.float32
        elif key.endswith(".lora_down.weight"):
            assert value.shape[0] == rank
        else:
            assert value.shape[1] == rank
    for key in REQUIRED_METADATA_KEYS:
        assert key in meta, key
    assert meta["sshs_model_hash"] == compute_sshs_hash(path)
    return tensors, meta


def test_resize_above_true_rank_is_exact_and_keeps_metadata(lora_file):
    before = hashlib.sha256(lora_file.read_bytes()).hexdigest()
    target, report = resize_file(lora_file, rank=4)
    assert target == lora_file.with_name("style-r4.safetensors")
    assert hashlib.sha256(lora_file.read_bytes()).hexdigest() == before  # the input is untouched
    original, _ = _read(lora_file)
    tensors, meta = _kohya_checks(target, 4)
    want, got = _deltas(original), _deltas(tensors)
    assert set(got) == set(want) and any(original[f"{n}.lora_down.weight"].ndim == 4 for n in want)
    for name in want:
        error = torch.linalg.matrix_norm(got[name] - want[name]) / torch.linalg.matrix_norm(want[name])
        assert error < 1e-5, (name, float(error))  # exact up to fp32 rounding: the true rank is 3 <= 4
        assert float(tensors[f"{name}.alpha"]) == pytest.approx(ALPHA * 4 / RANK)  # alpha / rank unchanged
    assert all(m.old_rank == RANK and m.new_rank == 4 and m.energy_kept > 1 - 1e-6 for m in report)
    assert meta["ss_network_dim"] == "4" and meta["ss_network_alpha"] == str(ALPHA * 4 / RANK)
    assert "made for the test" in meta["ss_training_comment"] and "from rank 8 to 4" in meta["stabletune_resize"]


def test_resize_below_true_rank_is_the_best_approximation(lora_file):
    """Below the true rank the error is what Eckart-Young says is optimal: the discarded singular values."""
    target, report = resize_file(lora_file, rank=2)
    original, _ = _read(lora_file)
    tensors, _ = _kohya_checks(target, 2)
    want, got = _deltas(original), _deltas(tensors)
    for module in report:
        sv = torch.linalg.svdvals(want[module.module])
        discarded = float((sv[2:] ** 2).sum())
        error = float(torch.linalg.matrix_norm(got[module.module] - want[module.module]) ** 2)
        assert error == pytest.approx(discarded, rel=1e-3, abs=1e-12)
        assert module.energy_kept == pytest.approx(1 - discarded / float((sv ** 2).sum()), abs=1e-5)
        assert module.energy_kept < 1 - 1e-4  # rank 2 really loses some of a rank-3 update


def test_resized_file_gives_the_same_unet_output_in_diffusers(lora_file, tiny_model):
    """Loaded by diffusers' kohya converter (what ComfyUI/A1111-style files go through), the rank-4 file
    gives the original file's UNet output; the rank-1 file does not."""
    from diffusers import StableDiffusionPipeline

    exact = lora_file.with_name("style-r4.safetensors")
    if not exact.exists():
        resize_file(lora_file, rank=4)
    lossy, _ = resize_file(lora_file, rank=1)
    gen = torch.Generator().manual_seed(7)
    latents, timesteps = torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([17, 640])
    hidden = torch.randn(2, 77, 32, generator=gen)

    def output(path):
        pipe = StableDiffusionPipeline.from_pretrained(str(tiny_model), local_files_only=True, safety_checker=None)
        pipe.load_lora_weights(str(path.parent), weight_name=path.name)
        with torch.no_grad():
            return pipe.unet(latents, timesteps, hidden).sample

    want = output(lora_file)
    torch.testing.assert_close(output(exact), want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(output(lossy), want, rtol=1e-4, atol=1e-5)


def test_cli_energy_mode_refusals_and_table(lora_file, capsys):
    from stabletune_core.cli import main

    assert main(["resize", str(lora_file), "--rank", "16"]) == 2
    assert capsys.readouterr().err.strip() == ("error: --rank 16 is above this LoRA's rank 8; a resize can only "
                                               "lower the rank.")
    assert not lora_file.with_name("style-r16.safetensors").exists()
    assert main(["resize", str(lora_file) + ".nope", "--rank", "2"]) == 2
    assert "does not exist" in capsys.readouterr().err
    done = subprocess.run([sys.executable, "-m", "stabletune_core", "resize", str(lora_file), "--energy", "0.999"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    target = lora_file.with_name("style-e99_9.safetensors")
    tensors, meta = _read(target)
    # Every update has true rank 3, so 99.9 % of its energy needs at most 3 directions (2 do not suffice here).
    ranks = {t.shape[0] for k, t in tensors.items() if k.endswith("lora_down.weight")}
    assert ranks == {3} and meta["ss_network_dim"] == "3"
    assert "energy kept: min" in done.stdout and "mean" in done.stdout and str(target) in done.stdout
    assert main(["resize", str(lora_file), "--energy", "0.999"]) == 2
    assert "already exists" in capsys.readouterr().err


def _factors(singular_values, rank=16, out=24, inner=20, seed=0):
    """A module whose update has exactly these singular values (orthonormal U, V; scale 1)."""
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(out, rank, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(inner, rank, generator=gen))
    s = torch.tensor(singular_values + [0.0] * (rank - len(singular_values)))
    return u * s, v.T  # B (out x r), A (r x inner)


def test_suggest_rank_names_used_ranks_and_the_energy_kept():
    five = [(f"m{i}", *reversed(_factors([1.0] * 5, seed=i)), 1.0) for i in range(3)]
    # Five equal directions: effective rank exactly 5; rank 4 keeps 80 %, rank 8 all of it.
    assert suggest_rank(spectra(five), 0.99) == "this LoRA uses ~5 of its 16 ranks: resize to 8 keeps 100 % of its energy"
    assert suggest_rank(spectra(five), 0.75) == "this LoRA uses ~5 of its 16 ranks: resize to 4 keeps 80 % of its energy"
    flat = [("m", *reversed(_factors([1.0] * 16)), 1.0)]
    assert suggest_rank(spectra(flat), 0.99) is None  # every rank is in use: nothing to offer
