"""The SD 2.x family on a tiny real-architecture SD2 (v-prediction, OpenCLIP-style text encoder): loading,
the shipped 2.1 config trees, training through the loop, and a kohya export that diffusers loads."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from stabletune_core.lora.export import read_lora_metadata
from stabletune_core.models import detect_family, get_family
from stabletune_core.models.sd.sd2 import SD21_BASE_CONFIG_DIR, SD21_CONFIG_DIR

PROMPTS = ["a photo of sks", "a red square on blue"]


@pytest.fixture(scope="module")
def tiny_sd2(tmp_path_factory) -> Path:
    from stabletune_core.models.sd.tiny import build_tiny_sd2

    return build_tiny_sd2(tmp_path_factory.mktemp("tiny-sd2") / "model", seed=0)


@pytest.fixture(scope="module")
def bundle(tiny_sd2):
    return get_family("sd2").load(str(tiny_sd2))


def _unet_out(unet, hidden, seed: int = 7) -> torch.Tensor:
    latents = torch.randn(len(PROMPTS), 4, 8, 8, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return unet(latents, torch.tensor([17, 640]), hidden).sample


def test_loads_as_v_prediction_with_open_clip_padding(tiny_sd2, bundle):
    family = bundle.family
    assert detect_family(tiny_sd2) == "sd2" and family.name == "sd2"
    assert bundle.prediction_type == "v_prediction"
    assert bundle.tokenizers[0].pad_token == "!" and bundle.tokenizers[0].pad_token_id == 0
    ids = family.tokenize(bundle, ["a cat"])[0].tolist()
    assert ids[:4] == [49406, 320, 2368, 49407] and set(ids[4:]) == {0}  # SD2 pads with "!", not <|endoftext|>
    meta = family.metadata(bundle)
    assert meta["ss_base_model_version"] == "sd_v2_v" and meta["ss_v2"] == "True"
    assert meta["modelspec.architecture"] == "stable-diffusion-v2-768-v/lora"
    assert meta["modelspec.prediction_type"] == "v" and meta["modelspec.resolution"] == "768x768"
    # the prediction-type switch: an epsilon (2.x-base) model is "sd_v2", 512 px
    bundle.noise_scheduler.register_to_config(prediction_type="epsilon")
    try:
        meta = family.metadata(bundle)
        assert meta["ss_base_model_version"] == "sd_v2" and family.base_model_version == "sd_v2"
        assert meta["modelspec.architecture"] == "stable-diffusion-v2-512/lora" and meta["modelspec.resolution"] == "512x512"
    finally:
        bundle.noise_scheduler.register_to_config(prediction_type="v_prediction")
        family.metadata(bundle)


def test_single_file_round_trip_and_config_choice(tiny_sd2, bundle, tmp_path):
    from stabletune_core.models.sd.tiny import build_tiny_sd2_single_file

    path = build_tiny_sd2_single_file(tmp_path / "tiny.safetensors", seed=0)
    with safe_open(str(path), framework="pt") as f:
        assert "cond_stage_model.model.transformer.resblocks.0.attn.in_proj_weight" in set(f.keys())
    assert detect_family(path) == "sd2"
    single = get_family("sd2").load(str(path), config_dir=tiny_sd2)
    with torch.no_grad():
        a = bundle.family.encode_prompts(bundle, PROMPTS).encoder_hidden_states
        b = single.family.encode_prompts(single, PROMPTS).encoder_hidden_states
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(_unet_out(bundle.denoiser, a), _unet_out(single.denoiser, b))
    family = get_family("sd2")
    assert family.single_file_config_dir(Path("v2-1_768-ema-pruned.safetensors")) == SD21_CONFIG_DIR
    assert family.single_file_config_dir(Path("v2-1_512-ema-pruned.safetensors")) == SD21_BASE_CONFIG_DIR


def test_shipped_sd21_config_trees():
    from diffusers import DDIMScheduler, PNDMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(SD21_CONFIG_DIR / "unet"))
        te = CLIPTextModel(CLIPTextConfig.from_pretrained(SD21_CONFIG_DIR / "text_encoder"))
    assert 865e6 < sum(p.numel() for p in unet.parameters()) < 866e6  # SD 2.x UNet: 865.9M
    assert 340e6 < sum(p.numel() for p in te.parameters()) < 341e6  # OpenCLIP ViT-H text tower minus its last layer
    assert unet.config.upcast_attention and unet.config.sample_size == 96
    v = DDIMScheduler.from_pretrained(SD21_CONFIG_DIR, subfolder="scheduler")
    eps = PNDMScheduler.from_pretrained(SD21_BASE_CONFIG_DIR, subfolder="scheduler")
    assert v.config.prediction_type == "v_prediction" and eps.config.prediction_type == "epsilon"
    assert UNet2DConditionModel.load_config(SD21_BASE_CONFIG_DIR / "unet")["sample_size"] == 64
    assert CLIPTokenizer.from_pretrained(SD21_CONFIG_DIR / "tokenizer").pad_token == "!"


@pytest.fixture(scope="module")
def trained(tiny_sd2, small_config, tmp_path_factory):
    from stabletune_core.train.loop import setup, train

    config = small_config(tiny_sd2, tmp_path_factory.mktemp("sd2run") / "run", train_batch_size=2, learning_rate=5e-3,
                          max_train_steps=3, train_text_encoder=True)
    session = setup(config)
    return session, train(config, session=session)


def test_training_and_kohya_export(trained, bundle, tiny_sd2):
    from diffusers import StableDiffusionPipeline

    session, path = trained
    metrics = [json.loads(line) for line in session.run.paths.metrics.read_text().splitlines()]
    assert len(metrics) == 3 and all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    fixed = torch.randn(2, 77, 32, generator=torch.Generator().manual_seed(9))
    b = session.bundle
    for m in (b.denoiser, *b.text_encoders):
        m.eval()
    want_unet = _unet_out(b.denoiser, fixed)
    assert not torch.allclose(_unet_out(bundle.denoiser, fixed), want_unet, atol=1e-4)

    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
    assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn2_to_k.lora_down.weight" in keys
    assert "lora_te_text_model_encoder_layers_1_self_attn_v_proj.lora_up.weight" in keys
    assert all(k.startswith(("lora_unet_", "lora_te_")) for k in keys)
    meta = read_lora_metadata(path)
    assert meta["ss_base_model_version"] == "sd_v2_v" and meta["ss_v2"] == "True"
    assert meta["modelspec.architecture"] == "stable-diffusion-v2-768-v/lora"
    assert meta["modelspec.prediction_type"] == "v"

    with torch.no_grad():
        want_text = b.family.encode_text(b, PROMPTS)["encoder_hidden_states"]
    pipe = StableDiffusionPipeline.from_pretrained(str(tiny_sd2), local_files_only=True, safety_checker=None)
    pipe.load_lora_weights(str(path))
    view = type(b)(family=b.family, denoiser=pipe.unet, vae=pipe.vae, text_encoders=[pipe.text_encoder],
                   tokenizers=[pipe.tokenizer], noise_scheduler=b.noise_scheduler, source="")
    with torch.no_grad():
        got_text = b.family.encode_text(view, PROMPTS)["encoder_hidden_states"]
    torch.testing.assert_close(got_text, want_text, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(_unet_out(pipe.unet, fixed), want_unet, rtol=1e-4, atol=1e-5)
