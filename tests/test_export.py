"""kohya / A1111 and diffusers LoRA export on the tiny model: names, metadata, hashes, and that loaders agree."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from safetensors import safe_open

from stabletune_core.lora.export import (
    REQUIRED_METADATA_KEYS,
    compute_sshs_hash,
    export_diffusers_lora,
    export_kohya_lora,
    read_lora_metadata,
)
from stabletune_core.lora.names import kohya_te_name, kohya_unet_name
from stabletune_core.models.sd.sd1 import SD1

RANK, ALPHA = 4, 8.0
PROMPTS = ["a photo of sks", "a red square on blue"]


@pytest.fixture(scope="module")
def trained(tiny_model):
    """The tiny model with LoRA on UNet and text encoder (rank 4, alpha 8, dropout on), lora_B randomised."""
    family = SD1()
    bundle = family.load(str(tiny_model))
    cfg = dict(r=RANK, lora_alpha=ALPHA, lora_dropout=0.1, init_lora_weights="gaussian")
    bundle.denoiser.add_adapter(LoraConfig(target_modules=family.unet_lora_targets, **cfg))
    te = bundle.text_encoders[0]
    # transformers >= 5.x's te.add_adapter() demands peft >= 0.22 (not released); peft's own injector is equivalent.
    inject_adapter_in_model(LoraConfig(target_modules=family.text_encoder_lora_targets, **cfg), te, adapter_name="default")
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for model in (bundle.denoiser, te):
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    bundle.denoiser.eval(), te.eval()
    return bundle


def _inputs():
    gen = torch.Generator().manual_seed(7)
    return torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([17, 640])


def _lora_modules(model):
    from peft.tuners.lora import LoraLayer

    return [n for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def _fresh_pipe(tiny_model):
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline.from_pretrained(str(tiny_model), local_files_only=True, safety_checker=None)


def _outputs(unet, text_encoder, tokenizer):
    latents, t = _inputs()
    with torch.no_grad():
        ids = tokenizer(PROMPTS, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
        hidden = text_encoder(ids, return_dict=False)[0]
        fixed = torch.randn(2, 77, 32, generator=torch.Generator().manual_seed(9))
        return hidden, unet(latents, t, fixed).sample


def test_names():
    assert kohya_unet_name("down_blocks.0.attentions.1.transformer_blocks.0.attn1.to_out.0") == (
        "lora_unet_down_blocks_0_attentions_1_transformer_blocks_0_attn1_to_out_0"
    )
    want = "lora_te_text_model_encoder_layers_3_self_attn_q_proj"
    assert kohya_te_name("encoder.layers.3.self_attn.q_proj") == want  # transformers >= 5.6 (flattened)
    assert kohya_te_name("text_model.encoder.layers.3.self_attn.q_proj") == want  # transformers 4.x
    assert kohya_te_name("text_model.encoder.layers.3.self_attn.q_proj", "lora_te2").startswith("lora_te2_text_model_")


def test_kohya_export(trained, tiny_model, tmp_path):
    bundle = trained
    family = bundle.family
    te = bundle.text_encoders[0]
    path = tmp_path / "out" / "my_lora.safetensors"
    user_meta = {"ss_steps": 10, "ss_learning_rate": "0.0001", "ss_tag_frequency": {"data": {"sks": 3}},
                 "ss_resolution": "(64, 64)", "ss_sd_model_name": "model"}
    export_kohya_lora(path, bundle.denoiser, [te], family, rank=RANK, alpha=ALPHA, metadata=user_meta, dtype=torch.float32)

    # --- keys
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    n_modules = len(_lora_modules(bundle.denoiser)) + len(_lora_modules(te))
    # 10 transformer blocks (3 down + 1 mid + 6 up) x (attn1, attn2) x 4 targets; 2 CLIP layers x 4 targets
    assert n_modules == 10 * 2 * 4 + 2 * 4
    assert len(tensors) == 3 * n_modules
    for key, value in tensors.items():
        assert key.startswith(("lora_unet_", "lora_te_")), key
        assert key.endswith((".lora_down.weight", ".lora_up.weight", ".alpha")), key
        if key.endswith(".alpha"):
            assert value.ndim == 0 and value.item() == ALPHA
        else:
            assert value.dtype == torch.float32
    assert "lora_te_text_model_encoder_layers_1_self_attn_out_proj.lora_up.weight" in tensors
    assert "lora_unet_mid_block_attentions_0_transformer_blocks_0_attn2_to_out_0.lora_down.weight" in tensors
    assert tensors["lora_unet_up_blocks_1_attentions_0_transformer_blocks_0_attn2_to_k.lora_down.weight"].shape == (RANK, 32)

    # --- metadata
    meta = read_lora_metadata(path)
    for key in REQUIRED_METADATA_KEYS:
        assert key in meta, key
    assert all(isinstance(v, str) for v in meta.values())
    assert meta["ss_network_module"] == "networks.lora" and meta["ss_network_dim"] == "4"
    assert meta["ss_network_alpha"] == "8.0" and meta["ss_v2"] == "False" and meta["ss_base_model_version"] == "sd_v1"
    assert meta["modelspec.architecture"] == "stable-diffusion-v1/lora" and meta["modelspec.sai_model_spec"] == "1.0.0"
    assert meta["ss_output_name"] == "my_lora" and meta["modelspec.title"] == "my_lora"
    assert meta["ss_steps"] == "10" and json.loads(meta["ss_tag_frequency"]) == {"data": {"sks": 3}}

    # --- hash: sha256 of everything after the 8-byte length and the JSON header
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    assert meta["sshs_model_hash"] == hashlib.sha256(raw[8 + header_len:]).hexdigest() == compute_sshs_hash(path)
    assert len(meta["sshs_legacy_hash"]) == 8

    # --- refuses to overwrite, no temp files left behind
    with pytest.raises(FileExistsError, match="overwrite=True"):
        export_kohya_lora(path, bundle.denoiser, [te], family, rank=RANK, alpha=ALPHA)
    export_kohya_lora(path, bundle.denoiser, [te], family, rank=RANK, alpha=ALPHA, overwrite=True)  # fp16 default
    assert sorted(p.name for p in path.parent.iterdir()) == ["my_lora.safetensors"]
    with safe_open(str(path), framework="pt") as f:
        assert f.get_tensor("lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight").dtype == torch.float16


def test_kohya_file_loads_in_diffusers_with_same_outputs(trained, tiny_model, tmp_path):
    bundle = trained
    te, tok = bundle.text_encoders[0], bundle.tokenizers[0]
    path = export_kohya_lora(tmp_path / "k.safetensors", bundle.denoiser, [te], bundle.family, rank=RANK, alpha=ALPHA,
                             dtype=torch.float32)
    want_hidden, want_unet = _outputs(bundle.denoiser, te, tok)

    pipe = _fresh_pipe(tiny_model)
    base_hidden, base_unet = _outputs(pipe.unet, pipe.text_encoder, pipe.tokenizer)
    assert not torch.allclose(base_unet, want_unet, atol=1e-4) and not torch.allclose(base_hidden, want_hidden, atol=1e-4)

    pipe.load_lora_weights(str(path))
    got_hidden, got_unet = _outputs(pipe.unet, pipe.text_encoder, pipe.tokenizer)
    torch.testing.assert_close(got_hidden, want_hidden, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_unet, want_unet, rtol=1e-4, atol=1e-5)


def test_diffusers_export_loads_with_same_outputs(trained, tiny_model, tmp_path):
    bundle = trained
    te, tok = bundle.text_encoders[0], bundle.tokenizers[0]
    target = export_diffusers_lora(tmp_path / "dlora", bundle.denoiser, [te], bundle.family)
    assert target.name == "pytorch_lora_weights.safetensors" and target.is_file()
    with pytest.raises(FileExistsError):
        export_diffusers_lora(tmp_path / "dlora", bundle.denoiser, [te], bundle.family)
    want_hidden, want_unet = _outputs(bundle.denoiser, te, tok)

    pipe = _fresh_pipe(tiny_model)
    pipe.load_lora_weights(str(target.parent))
    got_hidden, got_unet = _outputs(pipe.unet, pipe.text_encoder, pipe.tokenizer)
    torch.testing.assert_close(got_hidden, want_hidden, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_unet, want_unet, rtol=1e-4, atol=1e-5)


def _toy(**lora):
    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(8, 8))
    inject_adapter_in_model(LoraConfig(target_modules=["proj"], r=4, **lora), model, adapter_name="default")
    return model


def test_alpha_follows_peft_scaling():
    from stabletune_core.lora.export import iter_lora_modules

    [(name, down, up, alpha)] = list(iter_lora_modules(_toy(lora_alpha=8)))
    assert name == "proj" and down.shape == (4, 8) and up.shape == (8, 4) and alpha == 8.0
    # rsLoRA scales by alpha / sqrt(r) = 4; kohya applies alpha / r, so the file must say 16.
    [(_, _, _, alpha)] = list(iter_lora_modules(_toy(lora_alpha=8, use_rslora=True)))
    assert alpha == pytest.approx(16.0)


def test_refuses_what_kohya_cannot_express(tmp_path):
    from stabletune_core.lora.export import LoraExportError, iter_lora_modules

    with pytest.raises(LoraExportError, match="DoRA"):
        list(iter_lora_modules(_toy(lora_alpha=4, use_dora=True)))
    with pytest.raises(LoraExportError, match="nothing to export"):
        export_kohya_lora(tmp_path / "x.safetensors", torch.nn.Linear(2, 2), [], SD1(), rank=4, alpha=4)
    with pytest.raises(LoraExportError, match=r"\.safetensors"):
        export_kohya_lora(tmp_path / "x.pt", _toy(lora_alpha=4), [], SD1(), rank=4, alpha=4)
