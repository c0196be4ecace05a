"""Model families, the offline tokenizer, the tiny model and the single-file round trip."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from stabletune_core.models import ModelLoadError, detect_family, get_family
from stabletune_core.models.sd.sd1 import SD15_CONFIG_DIR, SD1
from stabletune_core.models.sd.tiny import build_tiny_sd1_single_file

PROMPTS = [
    "a photo of a cat",
    "Hello, World!  A  café naïve – \"quoted\" 123 4567",
    "sks person, masterpiece, (best quality:1.2), <lora:x:0.8>",
    "",
]


# ---------------------------------------------------------------- tokenizer
def test_tokenizer_matches_open_clip(tmp_path):
    import open_clip

    from stabletune_core.models.tokenizer import build_clip_tokenizer

    tok = build_clip_tokenizer(tmp_path / "tok")
    assert len(tok) == 49408
    assert tok.model_max_length == 77
    assert tok.pad_token == "<|endoftext|>" and tok.bos_token_id == 49406 and tok.eos_token_id == 49407
    reference = open_clip.get_tokenizer("ViT-L-14")
    long_prompt = " ".join(["word"] * 100)
    for text in PROMPTS + [long_prompt]:
        ours = tok(text, padding="max_length", max_length=77, truncation=True).input_ids
        theirs = reference([text])[0].tolist()
        n = theirs.index(49407) + 1  # open_clip pads with 0, SD1 pads with <|endoftext|>
        assert ours[:n] == theirs[:n], text
        assert all(t == 49407 for t in ours[n:])
        assert len(ours) == 77


def test_shipped_tokenizer_files_match_generated(tmp_path):
    from stabletune_core.models.tokenizer import write_clip_tokenizer_files

    write_clip_tokenizer_files(tmp_path)
    for name in ("vocab.json", "merges.txt"):
        assert (SD15_CONFIG_DIR / "tokenizer" / name).read_bytes() == (tmp_path / name).read_bytes()


# --------------------------------------------------------------- tiny model
@pytest.fixture(scope="module")
def tiny_bundle(tiny_model):
    return SD1().load(str(tiny_model))


def test_tiny_model_loads_and_encodes(tiny_model, tiny_bundle):
    b = tiny_bundle
    assert b.family.name == "sd1" and b.prediction_type == "epsilon"
    assert b.vae_scale_factor == 8 and b.denoiser.config.sample_size == 8
    assert type(b.noise_scheduler).__name__ == "DDPMScheduler"
    assert b.noise_scheduler.config.beta_schedule == "scaled_linear"
    cond = b.family.encode_prompts(b, PROMPTS[:3])
    assert cond.encoder_hidden_states.shape == (3, 77, 32)
    with torch.no_grad():
        latents = torch.randn(3, 4, 8, 8)
        out = b.denoiser(latents, torch.tensor([10, 500, 999]), cond.encoder_hidden_states).sample
        assert out.shape == latents.shape and torch.isfinite(out).all()
        z = b.vae.encode(torch.rand(1, 3, 64, 64) * 2 - 1).latent_dist.mean
        assert z.shape == (1, 4, 64 // b.vae_scale_factor, 64 // b.vae_scale_factor)
    meta = b.family.metadata(b)
    assert meta["ss_base_model_version"] == "sd_v1" and meta["ss_sd_model_name"] == Path(tiny_model).name
    assert detect_family(tiny_model) == "sd1"
    assert get_family("sd1").unet_lora_targets == ["to_q", "to_k", "to_v", "to_out.0"]


def test_tiny_build_is_deterministic(tmp_path):
    from stabletune_core.models.sd.tiny import build_tiny_components

    a, b = build_tiny_components(seed=5), build_tiny_components(seed=5)
    for name in ("unet", "vae", "text_encoder"):
        sa, sb = a[name].state_dict(), b[name].state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_single_file_round_trip(tiny_model, tiny_bundle, tmp_path):
    from safetensors import safe_open

    path = build_tiny_sd1_single_file(tmp_path / "tiny.safetensors", seed=0)
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
    assert "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight" in keys
    assert "first_stage_model.decoder.mid.attn_1.q.weight" in keys
    assert "cond_stage_model.transformer.text_model.encoder.layers.1.self_attn.q_proj.weight" in keys
    assert detect_family(path) == "sd1"

    single = SD1().load(str(path), config_dir=tiny_model)
    folder = tiny_bundle
    for name in ("denoiser", "vae"):
        sa, sb = getattr(folder, name).state_dict(), getattr(single, name).state_dict()
        assert set(sa) == set(sb)
        assert all(torch.equal(sa[k], sb[k]) for k in sa), name
    ta, tb = folder.text_encoders[0].state_dict(), single.text_encoders[0].state_dict()
    assert all(torch.equal(ta[k], tb[k]) for k in ta if not k.endswith("position_ids"))

    torch.manual_seed(0)
    latents, t = torch.randn(2, 4, 8, 8), torch.tensor([3, 700])
    with torch.no_grad():
        ca = folder.family.encode_prompts(folder, PROMPTS[:2]).encoder_hidden_states
        cb = single.family.encode_prompts(single, PROMPTS[:2]).encoder_hidden_states
        torch.testing.assert_close(ca, cb, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(folder.denoiser(latents, t, ca).sample, single.denoiser(latents, t, cb).sample, rtol=1e-5, atol=1e-6)
        image = torch.rand(1, 3, 64, 64) * 2 - 1
        torch.testing.assert_close(folder.vae(image).sample, single.vae(image).sample, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ refusals
def test_missing_path_is_one_sentence(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        SD1().load(str(tmp_path / "nope"))
    msg = str(e.value)
    assert "was not found" in msg and "\n" not in msg and msg.count(". ") == 0
    with pytest.raises(ModelLoadError, match="hub is off"):
        SD1().load("someone/some-model")


def test_ckpt_is_refused(tmp_path):
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(b"not really a pickle")
    with pytest.raises(ModelLoadError) as e:
        SD1().load(str(ckpt))
    msg = str(e.value)
    assert "convert it to .safetensors" in msg and "\n" not in msg


def test_folder_without_model_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="not a diffusers model"):
        SD1().load(str(tmp_path))


def test_unknown_family():
    with pytest.raises(ValueError, match="Unknown model family"):
        get_family("sd9")


# ------------------------------------------------------- shipped sd15 config
def test_shipped_sd15_configs_instantiate():
    from diffusers import AutoencoderKL, PNDMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    index = json.loads((SD15_CONFIG_DIR / "model_index.json").read_text())
    assert index["unet"] == ["diffusers", "UNet2DConditionModel"]
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(SD15_CONFIG_DIR / "unet"))
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(SD15_CONFIG_DIR / "vae"))
        te = CLIPTextModel(CLIPTextConfig.from_pretrained(SD15_CONFIG_DIR / "text_encoder"))
    n_unet = sum(p.numel() for p in unet.parameters())
    assert 855e6 < n_unet < 865e6  # SD1.5's UNet: 859.5M
    assert 83e6 < sum(p.numel() for p in vae.parameters()) < 84e6  # 83.65M
    assert 122e6 < sum(p.numel() for p in te.parameters()) < 124e6  # 123.06M
    sched = PNDMScheduler.from_pretrained(SD15_CONFIG_DIR, subfolder="scheduler")
    assert sched.config.beta_schedule == "scaled_linear" and sched.config.prediction_type == "epsilon"
    tok = CLIPTokenizer.from_pretrained(SD15_CONFIG_DIR / "tokenizer")
    assert len(tok) == 49408 and tok.pad_token == "<|endoftext|>"


def test_detect_family_from_keys(tmp_path):
    from safetensors.torch import save_file

    one = torch.zeros(1)
    save_file({"conditioner.embedders.1.model.ln_final.weight": one}, str(tmp_path / "xl.safetensors"))
    save_file({"cond_stage_model.model.ln_final.weight": one}, str(tmp_path / "v2.safetensors"))
    save_file({"cond_stage_model.transformer.text_model.final_layer_norm.weight": one}, str(tmp_path / "v1.safetensors"))
    assert detect_family(tmp_path / "xl.safetensors") == "sdxl"
    assert detect_family(tmp_path / "v2.safetensors") == "sd2"
    assert detect_family(tmp_path / "v1.safetensors") == "sd1"
    assert detect_family(tmp_path / "missing") == "sd1"


def test_encode_text_make_conditioning_and_pipeline(tiny_bundle):
    b = tiny_bundle
    with torch.no_grad():
        text = b.family.encode_text(b, PROMPTS[:2])
        assert set(text) == {"encoder_hidden_states"} and text["encoder_hidden_states"].shape == (2, 77, 32)
        cond = b.family.make_conditioning(b, text, None)
        torch.testing.assert_close(cond.encoder_hidden_states, b.family.encode_prompts(b, PROMPTS[:2]).encoder_hidden_states)
    pipe = b.family.make_pipeline(b)
    assert pipe.unet is b.denoiser and pipe.vae_scale_factor == b.vae_scale_factor
    out = pipe("a cat", height=64, width=64, num_inference_steps=2, generator=torch.Generator().manual_seed(0),
               output_type="np").images
    assert out.shape == (1, 64, 64, 3)
