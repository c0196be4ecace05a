"""The build script reproduces each shipped transformer-family toy base (FLUX.2 Klein, Z-Image; toy/flow_build.py):
same recipe, final losses within tolerance, same skill, within the 30-minute budget of the build's CPU time.

About 20 CPU minutes each, so they are marked slow and run by `bench/toy_rebuild.sh`, not in every CI run. Bitwise
equality is not promised across machines (float summation order), only the recorded numbers.
"""
from __future__ import annotations

import json
from importlib import import_module

import pytest

LOSS_TOLERANCE = 0.10  # relative, on the mean of the last training losses


@pytest.mark.slow
@pytest.mark.parametrize("piece", ["klein_build", "z_image_build"])
def test_rebuild_matches_the_shipped_manifest(tmp_path, piece):
    module = import_module(f"stabletune_core.toy.{piece}")
    shipped = json.loads((module.WEIGHTS / "manifest.json").read_text())
    rebuilt = module.build(tmp_path / "weights", vae_steps=shipped["vae_steps"], vae_batch=shipped["vae_batch"],
                           transformer_steps=shipped["transformer_steps"],
                           transformer_batch=shipped["transformer_batch"], transformer_lr=shipped["transformer_lr"],
                           scenes_per_combo=shipped["scenes_per_combo"], log=lambda message: None)
    for key in ("final_vae_loss", "final_transformer_loss"):
        assert rebuilt[key] == pytest.approx(shipped[key], rel=LOSS_TOLERANCE), key
    assert rebuilt["build_cpu_seconds"] <= 30 * 60
    assert rebuilt["scores"]["base_right"] >= shipped["scores"]["base_right"] - 0.05
    assert rebuilt["scores"]["concept_hue_error"] >= 30  # it never saw the concept colour


@pytest.mark.parametrize("piece, toy", [("klein_build", "TOY_KLEIN"), ("z_image_build", "TOY_Z_IMAGE")])
def test_the_build_normalises_latents_as_the_familys_runs_do(piece, toy):
    """Review D2: each builder declared a normalize(vae, raw) that only forwarded to its family's normalisation. The
    build asks the family face (ModelFamily.normalize_raw_latents), the very step encode_latents takes after
    encoding, so the latents the toy base learns are the ones a LoRA run on it trains on."""
    import dataclasses

    import torch

    from stabletune_core.toy.build import BUILD_SEED, pixels
    from stabletune_core.toy.flow_build import FlowToy, encode_scenes
    from stabletune_core.toy.world import base_scenes, draw_scene

    module = import_module(f"stabletune_core.toy.{piece}")
    assert not hasattr(module, "normalize")
    assert "normalize" not in {field.name for field in dataclasses.fields(FlowToy)}
    toy = getattr(module, toy)
    parts = toy.components(BUILD_SEED)
    scenes = base_scenes(3, seed=1)
    raw = encode_scenes(parts["vae"], scenes)
    with torch.no_grad():
        toy.set_latent_statistics(parts["vae"], raw)
    bundle = toy.bundle_of(parts)
    normalised = bundle.family.normalize_raw_latents(bundle, raw)
    assert normalised.dtype == torch.float32 and normalised.std() > 0.1
    assert torch.equal(normalised, bundle.family.encode_latents(bundle, pixels([draw_scene(s) for s in scenes])))
