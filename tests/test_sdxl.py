"""The SDXL family on a tiny real-architecture SDXL: loading (folder and single file), two text encoders and
size conditioning, training through the loop, and a kohya export that diffusers loads with the same outputs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from stabletune_core.lora.export import read_lora_metadata
from stabletune_core.models import detect_family, get_family
from stabletune_core.models.sd.sdxl import SDXL_BASE_CONFIG_DIR

PROMPTS = ["a photo of sks", "a red square on blue"]
SIZES = [{"original_size": (96, 64), "crop_top_left": (8, 0), "target_size": (64, 64)},
         {"original_size": (64, 64), "crop_top_left": (0, 0), "target_size": (64, 64)}]


@pytest.fixture(scope="module")
def tiny_sdxl(tmp_path_factory) -> Path:
    from stabletune_core.models.sd.tiny import build_tiny_sdxl

    return build_tiny_sdxl(tmp_path_factory.mktemp("tiny-sdxl") / "model", seed=0)


@pytest.fixture(scope="module")
def bundle(tiny_sdxl):
    return get_family("sdxl").load(str(tiny_sdxl))


def _unet_out(unet, cond, seed: int = 7) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn(len(PROMPTS), 4, 8, 8, generator=gen)
    with torch.no_grad():
        return unet(latents, torch.tensor([17, 640]), cond.encoder_hidden_states,
                    added_cond_kwargs=cond.added_cond_kwargs).sample


def test_loads_encodes_and_conditions_on_sizes(tiny_sdxl, bundle):
    family = bundle.family
    assert detect_family(tiny_sdxl) == "sdxl" and family.name == "sdxl"
    assert len(bundle.text_encoders) == 2 and type(bundle.text_encoders[1]).__name__ == "CLIPTextModelWithProjection"
    # SDXL's first tokenizer pads with <|endoftext|>, the OpenCLIP one with "!" (id 0)
    assert bundle.tokenizers[0].pad_token == "<|endoftext|>" and bundle.tokenizers[1].pad_token_id == 0
    with torch.no_grad():
        text = family.encode_text(bundle, PROMPTS)
        cond = family.make_conditioning(bundle, text, SIZES)
    assert text["prompt_embeds"].shape == (2, 77, 32 + 48) and text["pooled_prompt_embeds"].shape == (2, 48)
    assert cond.added_cond_kwargs["time_ids"].tolist() == [[96, 64, 8, 0, 64, 64], [64, 64, 0, 0, 64, 64]]
    # the conditioning is what diffusers' own SDXL pipeline computes
    pipe = family.make_pipeline(bundle)
    embeds, _, pooled, _ = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False)
    torch.testing.assert_close(embeds, text["prompt_embeds"])
    torch.testing.assert_close(pooled, text["pooled_prompt_embeds"])
    # the sizes really reach the UNet
    other = family.make_conditioning(bundle, text, [SIZES[1], SIZES[1]])
    assert not torch.allclose(_unet_out(bundle.denoiser, cond)[0], _unet_out(bundle.denoiser, other)[0])
    torch.testing.assert_close(_unet_out(bundle.denoiser, cond)[1], _unet_out(bundle.denoiser, other)[1])
    meta = family.metadata(bundle)
    assert meta["ss_base_model_version"] == "sdxl_base_v1-0"
    assert meta["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"
    assert meta["modelspec.resolution"] == "1024x1024" and meta["ss_v2"] == "False"


def test_single_file_round_trip(tiny_sdxl, bundle, tmp_path):
    from stabletune_core.models.sd.tiny import build_tiny_sdxl_single_file

    path = build_tiny_sdxl_single_file(tmp_path / "xl.safetensors", seed=0)
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
    assert "conditioner.embedders.1.model.transformer.resblocks.1.attn.in_proj_weight" in keys
    assert "model.diffusion_model.label_emb.0.0.weight" in keys
    assert detect_family(path) == "sdxl"
    single = get_family("sdxl").load(str(path), config_dir=tiny_sdxl)
    with torch.no_grad():
        a = bundle.family.encode_prompts(bundle, PROMPTS, sizes=SIZES)
        b = single.family.encode_prompts(single, PROMPTS, sizes=SIZES)
    torch.testing.assert_close(a.encoder_hidden_states, b.encoder_hidden_states)
    torch.testing.assert_close(a.added_cond_kwargs["text_embeds"], b.added_cond_kwargs["text_embeds"])
    torch.testing.assert_close(_unet_out(bundle.denoiser, a), _unet_out(single.denoiser, b))


def test_shipped_sdxl_config_tree():
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

    index = json.loads((SDXL_BASE_CONFIG_DIR / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline"
    assert index["text_encoder_2"] == ["transformers", "CLIPTextModelWithProjection"]
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(SDXL_BASE_CONFIG_DIR / "unet"))
        te2 = CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(SDXL_BASE_CONFIG_DIR / "text_encoder_2"))
    assert 2.56e9 < sum(p.numel() for p in unet.parameters()) < 2.57e9  # SDXL base UNet: 2.567B
    assert 694e6 < sum(p.numel() for p in te2.parameters()) < 695e6  # OpenCLIP bigG text tower: 694.7M
    vae = AutoencoderKL.load_config(SDXL_BASE_CONFIG_DIR / "vae")
    assert vae["scaling_factor"] == 0.13025 and vae["force_upcast"] is True
    assert CLIPTokenizer.from_pretrained(SDXL_BASE_CONFIG_DIR / "tokenizer_2").pad_token == "!"


@pytest.fixture(scope="module")
def trained(tiny_sdxl, small_config, tmp_path_factory):
    """Four steps of the real loop on the tiny SDXL, UNet and both text encoders."""
    from stabletune_core.train.loop import setup, train

    config = small_config(tiny_sdxl, tmp_path_factory.mktemp("xlrun") / "run", train_batch_size=2, learning_rate=5e-3,
                          max_train_steps=4, train_text_encoder=True)
    session = setup(config)
    path = train(config, session=session)
    return session, path


def test_training_changes_the_model_and_exports_kohya_names(trained, bundle):
    session, path = trained
    metrics = [json.loads(line) for line in session.run.paths.metrics.read_text().splitlines()]
    assert len(metrics) == 4 and all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    with torch.no_grad():
        cond = bundle.family.encode_prompts(bundle, PROMPTS, sizes=SIZES)
    assert not torch.allclose(_unet_out(bundle.denoiser, cond), _unet_out(session.bundle.denoiser, cond), atol=1e-4)

    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
    modules = {k.rsplit(".", 2)[0] if k.endswith("weight") else k.rsplit(".", 1)[0] for k in keys}
    assert {m.split("_", 2)[1] for m in modules} == {"unet", "te1", "te2"}
    # kohya's SDXL names: original SGM blocks, not diffusers' down_blocks/up_blocks
    assert "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q" in modules
    assert "lora_unet_middle_block_1_transformer_blocks_0_attn2_to_k" in modules
    assert "lora_unet_output_blocks_0_1_transformer_blocks_1_attn2_to_out_0" in modules
    assert not any("down_blocks" in m or "up_blocks" in m or "mid_block" in m for m in modules)
    assert "lora_te1_text_model_encoder_layers_1_self_attn_q_proj" in modules
    assert "lora_te2_text_model_encoder_layers_0_self_attn_out_proj" in modules
    # every transformer block x (attn1, attn2) x 4 targets; 2 encoders x 2 layers x 4 targets
    n_unet = sum(1 for m in modules if m.startswith("lora_unet_"))
    n_blocks = sum(1 for n, _ in session.bundle.denoiser.named_modules() if n.endswith("attn1.to_q"))
    assert n_unet == n_blocks * 2 * 4 and sum(1 for m in modules if m.startswith("lora_te")) == 16
    meta = read_lora_metadata(path)
    assert meta["ss_base_model_version"] == "sdxl_base_v1-0"
    assert meta["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"
    assert meta["modelspec.implementation"] == "https://github.com/Stability-AI/generative-models"
    assert meta["ss_network_dim"] == "4" and meta["ss_network_alpha"] == "8.0" and meta["ss_v2"] == "False"


def _outputs(pipe_or_bundle_unet, encoders, tokenizers, family, bundle):
    from stabletune_core.models.base import ModelBundle

    view = ModelBundle(family=family, denoiser=pipe_or_bundle_unet, vae=bundle.vae, text_encoders=encoders,
                       tokenizers=tokenizers, noise_scheduler=bundle.noise_scheduler, source="")
    with torch.no_grad():
        text = family.encode_text(view, PROMPTS)
        fixed = family.make_conditioning(bundle, {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(9))
                                                  for k, v in text.items()}, SIZES)
        return text, _unet_out(pipe_or_bundle_unet, fixed)


def test_kohya_export_loads_in_diffusers_with_same_outputs(trained, tiny_sdxl):
    from diffusers import StableDiffusionXLPipeline

    session, path = trained
    b = session.bundle
    for m in (b.denoiser, *b.text_encoders):
        m.eval()
    want_text, want_unet = _outputs(b.denoiser, b.text_encoders, b.tokenizers, b.family, b)

    pipe = StableDiffusionXLPipeline.from_pretrained(str(tiny_sdxl), local_files_only=True)
    encoders, tokenizers = [pipe.text_encoder, pipe.text_encoder_2], [pipe.tokenizer, pipe.tokenizer_2]
    base_text, base_unet = _outputs(pipe.unet, encoders, tokenizers, b.family, b)
    assert not torch.allclose(base_unet, want_unet, atol=1e-4)
    assert not torch.allclose(base_text["pooled_prompt_embeds"], want_text["pooled_prompt_embeds"], atol=1e-4)

    pipe.load_lora_weights(str(path))
    got_text, got_unet = _outputs(pipe.unet, encoders, tokenizers, b.family, b)
    for key in want_text:
        torch.testing.assert_close(got_text[key], want_text[key], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_unet, want_unet, rtol=1e-4, atol=1e-5)


def test_cached_latents_and_text_train(tiny_sdxl, tiny_config):
    """The text cache must hold both encoders' outputs and the pooled embedding; the time ids are not text."""
    from stabletune_core.train.loop import setup, train

    config = tiny_config(pretrained_model_name_or_path=str(tiny_sdxl), cache_latents=True,
                         cache_text_embeddings=True, max_train_steps=2, train_batch_size=2)
    session = setup(config)
    train(config, session=session)
    metrics = [json.loads(line) for line in session.run.paths.metrics.read_text().splitlines()]
    assert len(metrics) == 2 and all(m["loss"] == m["loss"] for m in metrics)
    caption = session.data.example(0, 0, with_pixels=False)["caption"]
    stored = session.inputs.text_cache.get_batch([caption])
    assert set(stored) == {"prompt_embeds", "pooled_prompt_embeds"} and stored["pooled_prompt_embeds"].shape == (1, 48)


def test_flip_mirrors_the_crop_coordinates(tmp_path):
    """A horizontal flip shows the crop seen from the other edge, so SDXL's crop_left must be mirrored too
    (kohya: scaled width - left - target width): the flipped pixels are exactly the mirrored scaled image
    cropped at the reported (top, left)."""
    import numpy as np
    from PIL import Image

    from stabletune_core.data.scan import scan_dataset
    from views import view_of

    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (80, 200, 3), dtype=np.uint8)).save(tmp_path / "wide.png")
    scan = scan_dataset(tmp_path, default_caption="wide")

    def view(flip: bool):
        return view_of(scan, 64, enable_bucket=False, random_crop=True, flip=flip, seed=1)

    # an epoch with a flip (random_flip flips half the time) and an off-centre crop, so mirroring moves it
    epoch = next(e for e in range(40) if view(True).example(0, epoch=e)["flipped"] and
                 view(False).example(0, epoch=e)["crop_top_left"][1] != 160 - 64 - view(False).example(
                     0, epoch=e)["crop_top_left"][1])
    plain, flipped = view(False).example(0, epoch=epoch), view(True).example(0, epoch=epoch)
    (top, left), (f_top, f_left) = plain["crop_top_left"], flipped["crop_top_left"]
    scaled = Image.open(tmp_path / "wide.png").convert("RGB").resize((160, 64), Image.Resampling.LANCZOS)
    assert (f_top, f_left) == (top, 160 - 64 - left)
    mirrored = np.asarray(scaled.transpose(Image.Transpose.FLIP_LEFT_RIGHT), dtype=np.float32)
    expected = torch.from_numpy(mirrored[f_top:f_top + 64, f_left:f_left + 64].copy()).permute(2, 0, 1) / 127.5 - 1
    assert torch.allclose(flipped["pixel_values"], expected, atol=1e-6)
    assert torch.equal(flipped["pixel_values"], plain["pixel_values"].flip(-1))  # same crop, mirrored
    # the latent-cache path (no pixels decoded) reports the same coordinates
    assert view(True).example(0, epoch=epoch, with_pixels=False)["crop_top_left"] == (f_top, f_left)
