"""Learning you can see on Z-Image (issue 39 item 5): the shipped toy Z-Image base draws the toy world it was trained
on, and `demo --family z_image` teaches it the held-out colour, measured as the SD 1.x and Klein demos are.

Every claim is a measure on generated images, in units (toy/score.py), over 8 seeds per prompt: the concept's hue
error against the run's own training images, each kept colour's drift against the base's own image at the same
prompt and seed, shapes right in percent. The demo runs once per module, exactly as a user runs it.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from toy_flow_checks import (CONCEPT_BEFORE_MIN_DEG, ROOT, base_images_of, base_measures, check_console_summary,
                             check_report, check_summary_passes, demo_report, lora_pipeline, run_demo)
from stabletune_core.toy.world import BASE_COLORS, CONCEPT_COLOR

#: Issue 39.5's targets over 8 seeds per prompt: purple within 6 deg of the run's own training images (the drift
#: and shape targets, 3 deg and 90 %, are toy_flow_checks'). The base's own shapes are the issue's third target: the
#: first shipped base drew 79 % of them right (its squares round) and could not carry a LoRA to 90 %; the rebuilt one
#: (flow_shift 1, 8500 steps at 4e-3; bench/RESULTS.md) must draw 90 % right, every colour within 6 deg.
CONCEPT_AFTER_MAX_DEG = 6.0
BASE_RIGHT_MIN = 0.90  # right colour and right shape


def test_the_toy_build_writes_a_z_image_base_the_family_loads(tmp_path, one_thread):
    """`toy build --family z_image`'s recipe, run for a few steps: the transformer-family build (toy/flow_build.py)
    writes the shipped files and a manifest of their hashes, and the diffusers folder they make is one the z_image
    family loads as Z-Image Base, with the toy's latent statistics in its VAE."""
    from stabletune_core.models.z_image.family import ZImage
    from stabletune_core.toy.z_image import materialize
    from stabletune_core.toy.z_image_build import build

    out = tmp_path / "weights"
    manifest = build(out, vae_steps=2, transformer_steps=2, scenes_per_combo=2, eval_seeds=1, evaluate_every=1,
                     log=lambda message: None)
    assert manifest["family"] == "z_image" and manifest["transformer_steps"] == 2
    assert manifest["objective"]["flow_shift"] == 1.0  # the recipe's training shift, not the scheduler's 3
    assert manifest["max_sequence_length"] == 32
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest, name
    bundle = ZImage().load(materialize(out, tmp_path / "toy-z-image"))
    assert bundle.extra["distillation"].verdict == "base"
    vae = json.loads((out / "configs.json").read_text())["vae"]
    assert (vae["scaling_factor"], vae["shift_factor"]) != (0.3611, 0.1159)  # the toy world's, not FLUX.1's


@pytest.fixture(scope="module")
def z_image_base(toy_cache) -> Path:
    from stabletune_core.toy.z_image import WEIGHTS, materialize

    return materialize(WEIGHTS, toy_cache / "toy-z-image")


@pytest.fixture(scope="module")
def z_image_pipe(z_image_base):
    from stabletune_core.toy.z_image import load_toy_z_image_pipeline

    return load_toy_z_image_pipeline(z_image_base)


def test_the_shipped_toy_z_image_is_a_z_image_base_the_family_loads(z_image_base):
    """The materialised folder is what the z_image family loads: Z-Image Base (not Turbo), with its tokenizer, and
    the shipped manifest's hashes match the shipped files; the build stayed within the issue's 30 CPU minutes."""
    from stabletune_core.models.z_image.family import ZImage
    from stabletune_core.toy.z_image import WEIGHTS

    manifest = json.loads((WEIGHTS / "manifest.json").read_text())
    assert manifest["family"] == "z_image"
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((WEIGHTS / name).read_bytes()).hexdigest() == digest, name
    assert manifest["build_cpu_seconds"] <= 30 * 60
    scores = manifest["scores"]  # what the build measured on the shipped weights, 8 seeds per base prompt
    assert scores["base_shape_score"] >= BASE_RIGHT_MIN and scores["base_color_score"] == 1.0, scores
    bundle = ZImage().load(z_image_base)
    assert bundle.extra["distillation"].verdict == "base"
    tokens = {c: tuple(bundle.tokenizers[0].tokenize(f"a {c} circle")) for c in (*BASE_COLORS, CONCEPT_COLOR)}
    assert len(set(tokens.values())) == len(tokens), tokens


@pytest.fixture(scope="module")
def base_images(z_image_pipe) -> dict[str, list]:
    return base_images_of(z_image_pipe)


def test_the_toy_z_image_base_draws_the_colour_and_shape_it_is_asked_for(base_images, one_thread):
    """Right colour (within 6 degrees of the palette) and right shape for most of the base prompts' images over 8
    seeds; the concept colour, never seen, is far off."""
    right, _, concept = base_measures(base_images)
    assert right >= BASE_RIGHT_MIN, right
    assert concept >= CONCEPT_BEFORE_MIN_DEG, concept


@pytest.fixture(scope="module")
def z_image_demo(tmp_path_factory, toy_cache):
    """`demo --family z_image`, run as a user runs it; returns (run dir, console output)."""
    return run_demo("z_image", tmp_path_factory.mktemp("z-image-demo") / "demo", toy_cache)


@pytest.fixture(scope="module")
def z_image_lora_pipe(z_image_demo, z_image_base):
    """A fresh ZImagePipeline of the toy Z-Image with the demo's exported LoRA, loaded as a user would."""
    from stabletune_core.toy.z_image import load_toy_z_image_pipeline

    run, _ = z_image_demo
    return lora_pipeline(load_toy_z_image_pipeline, z_image_base, run / "output" / "demo_z_image_lora.safetensors")


@pytest.fixture(scope="module")
def z_image_report(z_image_demo, base_images, z_image_lora_pipe) -> dict:
    run, _ = z_image_demo
    return demo_report("toy Z-Image", run, base_images, z_image_lora_pipe)


def test_demo_teaches_the_toy_z_image_the_concept_and_keeps_its_colours(z_image_demo, z_image_report, one_thread):
    """`demo --family z_image` brings purple from ~139 degrees off its training images to within the SD and Klein
    demos' 8 degrees and keeps every base colour near the base's own image, measured on 8 seeds with the exported LoRA
    in diffusers' ZImagePipeline; the run says it in degrees. These bounds are the SD and Klein demos' (the shipped
    demo on the rebuilt base: purple 5.49 deg off, worst drift 1.97 deg (green), shapes 100 %); the next test holds
    it to issue 39.5's."""
    run, console = z_image_demo
    check_report(z_image_report, concept_max_deg=8.0)
    check_console_summary(console)


def test_demo_meets_issue_39_5s_targets_over_8_seeds(z_image_report, one_thread):
    """Issue 39.5: purple within 6 degrees of its training images, every kept colour within 3 degrees of the base,
    base shapes 90 % right, over 8 seeds per prompt."""
    check_report(z_image_report, concept_max_deg=CONCEPT_AFTER_MAX_DEG)


def test_the_z_image_demos_own_summary_passes_at_its_validation_seeds(z_image_demo):
    """What the user reads: the run's own summary, on its validation prompts and seeds (2 per prompt), meets the
    targets too and says pass."""
    run, console = z_image_demo
    check_summary_passes(run, console, concept_max_deg=CONCEPT_AFTER_MAX_DEG)


def test_the_toy_z_image_is_rendered_and_taught_at_the_text_length_it_was_built_with(z_image_base, z_image_pipe,
                                                                                      one_thread):
    """The toy Z-Image is built, sampled and taught at TEXT_LENGTH tokens: its pipeline renders at that length
    unless told otherwise (the image diffusers' own ZImagePipeline draws at it), the manifest records it, and the
    demo preset trains and validates with it."""
    import tomllib

    import torch
    from diffusers import ZImagePipeline

    from stabletune_core.toy.z_image import TEXT_LENGTH, WEIGHTS

    assert json.loads((WEIGHTS / "manifest.json").read_text())["max_sequence_length"] == TEXT_LENGTH
    preset = tomllib.loads((ROOT / "presets" / "demo-z_image.toml").read_text())
    assert preset["max_sequence_length"] == TEXT_LENGTH and preset["model_family"] == "z_image"
    plain = ZImagePipeline.from_pretrained(str(z_image_base), local_files_only=True)

    def image(pipe, **kwargs) -> torch.Tensor:
        return pipe(prompt="a red circle", height=64, width=64, num_inference_steps=2, guidance_scale=2.0,
                    generator=torch.Generator().manual_seed(0), output_type="pt", **kwargs).images

    lengths = []
    encode = z_image_pipe.encode_prompt

    def counted(*args, **kwargs):
        lengths.append(kwargs.get("max_sequence_length"))
        return encode(*args, **kwargs)

    z_image_pipe.encode_prompt = counted
    try:
        toy = image(z_image_pipe)
    finally:
        del z_image_pipe.encode_prompt
    assert lengths == [TEXT_LENGTH]  # the prompt and the empty negative one, encoded together at the toy's length
    assert torch.equal(toy, image(plain, max_sequence_length=TEXT_LENGTH))
