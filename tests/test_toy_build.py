"""The build script reproduces the shipped toy base: same recipe, final losses within tolerance, same skill.

About 20 minutes on 2 idle CPU cores, so it is marked slow and run by `bench/toy_rebuild.sh`, not in every CI run.
Bitwise equality is not promised across machines (float summation order), only the recorded numbers.
"""
from __future__ import annotations

import json

import pytest

from stabletune_core.toy import WEIGHTS

LOSS_TOLERANCE = 0.10  # relative, on the mean of the last training losses


@pytest.mark.slow
def test_rebuild_matches_the_shipped_manifest(tmp_path):
    from stabletune_core.toy.build import build

    shipped = json.loads((WEIGHTS / "manifest.json").read_text())
    rebuilt = build(tmp_path / "weights", vae_steps=shipped["vae_steps"], vae_batch=shipped["vae_batch"],
                    vae_polish_steps=shipped.get("vae_polish_steps", 0),
                    unet_steps=shipped["unet_steps"], unet_batch=shipped["unet_batch"],
                    scenes_per_combo=shipped["scenes_per_combo"], vae_images=shipped.get("vae_images", "named"),
                    vae_edge_weight=shipped.get("vae_edge_weight", 0.0),
                    vae_polish_edge_weight=shipped.get("vae_polish_edge_weight", 0.0),
                    vae_polish_mean_latents=shipped.get("vae_polish_mean_latents", False),
                    unet_posterior_spread=shipped.get("unet_posterior_spread", 1.0),
                    vae_posterior_std_scale=shipped.get("vae_posterior_std_scale", 1.0),
                    text_embedding_std=shipped.get("text_embedding_std", 0.0),
                    text_residual_scale=shipped.get("text_residual_scale", 1.0),
                    text_attention_scale=shipped.get("text_attention_scale", 1.0),
                    text_position_scale=shipped.get("text_position_scale", 1.0), log=lambda message: None)
    for key in ("final_vae_loss", "final_unet_loss"):
        assert rebuilt[key] == pytest.approx(shipped[key], rel=LOSS_TOLERANCE), key
    assert rebuilt["scores"]["base_right"] >= 0.95  # colour within 6 degrees and right shape, 8 seeds
    assert rebuilt["scores"]["concept_hue_error"] >= 30  # it never saw the concept colour
    if shipped.get("vae_images") == "hue_circle":
        assert rebuilt["codec_floor"]["worst_hue_deg"] <= 3.5  # its codec carries every hue (issue 35.1)


def test_the_posterior_spread_scales_and_its_mean_stays_bitwise():
    """build(vae_posterior_std_scale=s): the shipped VAE's posterior std is s times what it was, its mean (what the
    denoiser trained on and the codec floor reads) bitwise the same, so the base draws exactly as before."""
    import torch
    from diffusers import AutoencoderKL

    from stabletune_core.models.sd.tiny import VAE_CONFIG
    from stabletune_core.toy.build import TOY_VAE_CONFIG, scale_posterior_std

    torch.manual_seed(0)
    vae = AutoencoderKL(**dict(VAE_CONFIG, **TOY_VAE_CONFIG)).eval()
    x = torch.rand(2, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        before = vae.encode(x).latent_dist
        scale_posterior_std(vae, 0.1)
        after = vae.encode(x).latent_dist
    assert torch.equal(after.mean, before.mean)
    assert torch.allclose(after.std, 0.1 * before.std, rtol=1e-4)


def _colour_word_similarity(text_encoder, tokenizer) -> dict[tuple[str, str], float]:
    """Cosine similarity of each pair of colour words' features at the word's own position ("a WORD circle")."""
    import itertools

    import torch

    words = ["red", "yellow", "green", "purple", "blue", "orange", "magenta", "teal", "lime"]
    features = {}
    for word in words:
        ids = tokenizer(f"a {word} circle", padding="max_length", max_length=tokenizer.model_max_length,
                        return_tensors="pt").input_ids
        with torch.no_grad():
            features[word] = text_encoder(ids)[0][0, 2]
    return {(a, b): float(torch.nn.functional.cosine_similarity(features[a], features[b], dim=0))
            for a, b in itertools.combinations(words, 2)}


def test_loud_token_embeddings_set_the_colour_words_apart():
    """build(text_embedding_std=1): the frozen random CLIP's colour words reach the denoiser as different features,
    as a trained encoder's do; at its initialisation (std 0.02) they are nearly one feature, so a LoRA that moves
    the new word moves its neighbour (purple and red, bench/RESULTS.md)."""
    from stabletune_core.models.sd.tiny import build_tiny_components
    from stabletune_core.models.tokenizer import build_clip_tokenizer
    from stabletune_core.toy.build import BUILD_SEED, loud_token_embeddings

    tokenizer = build_clip_tokenizer()
    text_encoder = build_tiny_components(BUILD_SEED)["text_encoder"].eval()
    quiet = _colour_word_similarity(text_encoder, tokenizer)
    assert min(quiet.values()) > 0.7 and quiet[("red", "purple")] > 0.9
    loud_token_embeddings(text_encoder, BUILD_SEED, 1.0)
    loud = _colour_word_similarity(text_encoder, tokenizer)
    assert max(loud.values()) < 0.6, max(loud, key=loud.get)


def test_the_text_residual_stream_scales_to_clips_embedding_scale_and_its_features_stay():
    """build(text_embedding_std=1, text_residual_scale=0.02): the loud encoder's colour words stay apart, and every
    feature it hands the denoiser stays what it was (the layer norms see their inputs scaled), while its token
    embeddings sit at a real CLIP's 0.02, where an embedding learning rate sized for CLIP means what it says."""
    import torch

    from stabletune_core.models.sd.tiny import build_tiny_components
    from stabletune_core.models.tokenizer import build_clip_tokenizer
    from stabletune_core.toy.build import BUILD_SEED, loud_token_embeddings, scale_text_residual_stream

    tokenizer = build_clip_tokenizer()
    text_encoder = build_tiny_components(BUILD_SEED)["text_encoder"].eval()
    loud_token_embeddings(text_encoder, BUILD_SEED, 1.0)
    ids = tokenizer(["a purple triangle", "a red circle", ""], padding="max_length",
                    max_length=tokenizer.model_max_length, return_tensors="pt").input_ids
    with torch.no_grad():
        loud = text_encoder(ids)[0]
    scale_text_residual_stream(text_encoder, 0.02)
    with torch.no_grad():
        scaled = text_encoder(ids)[0]
    assert float((scaled - loud).norm() / loud.norm()) < 1e-5
    assert abs(float(text_encoder.get_input_embeddings().weight.std()) - 0.02) < 0.001
    apart = _colour_word_similarity(text_encoder, tokenizer)
    assert max(apart.values()) < 0.6, max(apart, key=apart.get)


def test_quiet_text_attention_sets_the_colour_words_apart_at_clips_scale():
    """build(text_attention_scale=0.03, text_position_scale=0.1): without most of the random attention's mixing
    each colour word's hidden state is its own MLP feature (purple and red 0.95 cosine-alike before), the token
    embeddings keep CLIP's 0.02 and the stream stays about as loud as the initial encoder's."""
    import torch

    from stabletune_core.models.sd.tiny import build_tiny_components
    from stabletune_core.models.tokenizer import build_clip_tokenizer
    from stabletune_core.toy.build import BUILD_SEED, quiet_text_attention

    tokenizer = build_clip_tokenizer()
    text_encoder = build_tiny_components(BUILD_SEED)["text_encoder"].eval()
    embeddings = text_encoder.get_input_embeddings().weight.detach().clone()
    ids = tokenizer(["a purple circle"], padding="max_length", max_length=tokenizer.model_max_length,
                    return_tensors="pt").input_ids
    with torch.no_grad():
        loud_before = float(text_encoder(ids, output_hidden_states=True).hidden_states[-1].std())
    quiet_text_attention(text_encoder, 0.03, 0.1)
    apart = _colour_word_similarity(text_encoder, tokenizer)
    assert apart[("red", "purple")] < 0.3 and sum(apart.values()) / len(apart) < 0.4, max(apart, key=apart.get)
    with torch.no_grad():
        loud_after = float(text_encoder(ids, output_hidden_states=True).hidden_states[-1].std())
    assert loud_after > loud_before / 3  # the stream stays loud: the MLPs still write into it
    assert torch.equal(text_encoder.get_input_embeddings().weight, embeddings)
