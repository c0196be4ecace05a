"""Learning you can see on FLUX.2 Klein (issue 23 item 5): the shipped toy Klein base draws the toy world it was
trained on, and `demo --family flux2_klein` teaches it the held-out colour, measured as the SD 1.x demo is.

Every claim is a measure on generated images, in units (toy/score.py), over 8 seeds per prompt: the concept's hue
error against the run's own training images, each kept colour's drift against the base's own image at the same
prompt and seed, shapes right in percent. The demo runs once per module, exactly as a user runs it.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from toy_flow_checks import (CONCEPT_BEFORE_MIN_DEG, ROOT, base_images_of, base_measures, check_demo_learns,
                             check_summary_passes, lora_pipeline, run_cli, run_demo)
from stabletune_core.toy.world import BASE_COLORS, CONCEPT_COLOR

#: Issue 23.5's targets, the SD demo's (tests/test_toy_learning.py), over 8 seeds per prompt (the drift and shape
#: targets are toy_flow_checks'). Measured on the v3 base (build manifest): right 94 %, shapes 97 %; its demo
#: (presets/demo-flux2-klein.toml, kleindemo report): purple 6.8 deg off, worst drift 2.7 deg (green), shapes 96 %.
BASE_RIGHT_MIN = 0.90  # right colour (within 6 deg of the palette) and right shape
CONCEPT_AFTER_MAX_DEG = 8.0  # purple within 8 deg of the run's own training images


def test_an_unknown_demo_family_is_one_sentence_before_anything_is_built(tmp_path):
    done = run_cli("stabletune_core", "demo", "--family", "flux3", "--output_dir", str(tmp_path / "run"),
                   cache=tmp_path / "cache", timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: There is no toy base of model family 'flux3': choose 'sd1', "
                                   "'flux2_klein' or 'z_image'.")
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()  # nothing built, nothing loaded


def test_an_unknown_toy_build_family_is_one_sentence_before_anything_is_built(tmp_path):
    done = run_cli("stabletune_core.toy", "build", "--family", "sdxl", "--out", str(tmp_path / "weights"),
                   cache=tmp_path / "cache", timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: There is no toy base of model family 'sdxl': choose 'sd1', "
                                   "'flux2_klein' or 'z_image'.")
    assert not (tmp_path / "weights").exists()


@pytest.fixture(scope="module")
def klein_base(toy_cache) -> Path:
    from stabletune_core.toy.klein import WEIGHTS, materialize

    return materialize(WEIGHTS, toy_cache / "toy-klein")


@pytest.fixture(scope="module")
def klein_pipe(klein_base):
    from stabletune_core.toy.klein import load_toy_klein_pipeline

    return load_toy_klein_pipeline(klein_base)


def test_the_shipped_toy_klein_is_a_klein_base_the_family_loads(klein_base):
    """The materialised folder is what the flux2_klein family loads: a Klein base (not distilled), with its
    tokenizer, and the shipped manifest's hashes match the shipped files."""
    import hashlib
    import json

    from stabletune_core.models.flux2_klein.family import Flux2Klein
    from stabletune_core.toy.klein import WEIGHTS

    manifest = json.loads((WEIGHTS / "manifest.json").read_text())
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((WEIGHTS / name).read_bytes()).hexdigest() == digest, name
    assert manifest["build_cpu_seconds"] <= 30 * 60  # the budget: 30 minutes of the build's CPU time
    bundle = Flux2Klein().load(klein_base)
    assert bundle.extra["distillation"].verdict == "base"
    # the tokenizer tells the toy world's words apart (each colour is its own token)
    tokens = {c: tuple(bundle.tokenizers[0].tokenize(f"a {c} circle")) for c in (*BASE_COLORS, CONCEPT_COLOR)}
    assert len(set(tokens.values())) == len(tokens), tokens


@pytest.fixture(scope="module")
def base_images(klein_pipe) -> dict[str, list]:
    """The base's images of every base prompt and of the concept prompts, 8 seeds each (rendered once: the base
    report and the demo's drift read the same images)."""
    return base_images_of(klein_pipe)


# Not slow: its 96 + 24 base images (39 s at load 6, one thread) are the ones the demo test's drift reads anyway.
def test_the_toy_klein_base_draws_the_colour_and_shape_it_is_asked_for(base_images, one_thread):
    """Right colour (within 6 degrees of the palette) and right shape for most of the base prompts' images over 8
    seeds (evaluate.base_report's measures); the concept colour, never seen, is far off."""
    right, _, concept = base_measures(base_images)
    assert right >= BASE_RIGHT_MIN, right
    assert concept >= CONCEPT_BEFORE_MIN_DEG, concept


@pytest.fixture(scope="module")
def klein_demo(tmp_path_factory, toy_cache):
    """`demo --family flux2_klein`, run as a user runs it; returns (run dir, console output)."""
    return run_demo("flux2_klein", tmp_path_factory.mktemp("klein-demo") / "demo", toy_cache)


@pytest.fixture(scope="module")
def klein_lora_pipe(klein_demo, klein_base):
    """A fresh Flux2KleinPipeline of the toy Klein with the demo's exported LoRA, loaded as a user would."""
    from stabletune_core.toy.klein import load_toy_klein_pipeline

    run, _ = klein_demo
    return lora_pipeline(load_toy_klein_pipeline, klein_base, run / "output" / "demo_klein_lora.safetensors")


# Not slow: 2 min 40 s at load 6 on one thread with the base images above (the demo as a user runs it, toy base and
# prior images included, 80 s; the LoRA's 120 images 43 s), under the ~4 minutes a slow mark is for.
def test_demo_teaches_the_toy_klein_the_concept_and_keeps_its_colours(klein_demo, base_images, klein_lora_pipe,
                                                                       one_thread):
    """`demo --family flux2_klein` ends with purple close to its training images and the base colours kept,
    measured on 8 seeds with the exported LoRA in diffusers' own pipeline; the run says it in degrees."""
    run, console = klein_demo
    check_demo_learns("toy Klein", run, console, base_images, klein_lora_pipe, concept_max_deg=CONCEPT_AFTER_MAX_DEG)


def test_the_klein_demos_own_summary_passes_at_its_validation_seeds(klein_demo):
    """What the user reads: the run's own summary, on its validation prompts and seeds (2 per prompt), meets the
    targets too, not only the 8-seed measure (it read red 4 / green 4 deg, 'not yet', with 2 prior images per
    base prompt)."""
    run, console = klein_demo
    check_summary_passes(run, console, concept_max_deg=CONCEPT_AFTER_MAX_DEG)


def test_the_toy_klein_is_rendered_and_taught_at_the_text_length_it_was_built_with(klein_base, klein_pipe,
                                                                                    one_thread):
    """The toy's prompts are short, so the toy Klein is built, sampled and taught at TEXT_LENGTH tokens instead of
    the pipeline's 512 (max_sequence_length): its pipeline renders at that length unless told otherwise, the
    manifest records it, and the demo preset trains and validates with it."""
    import json
    import tomllib

    import torch
    from diffusers import Flux2KleinPipeline

    from stabletune_core.toy.klein import TEXT_LENGTH, WEIGHTS

    assert json.loads((WEIGHTS / "manifest.json").read_text())["max_sequence_length"] == TEXT_LENGTH
    preset = tomllib.loads((ROOT / "presets" / "demo-flux2-klein.toml").read_text())
    assert preset["max_sequence_length"] == TEXT_LENGTH
    plain = Flux2KleinPipeline.from_pretrained(str(klein_base), local_files_only=True)

    def image(pipe, **kwargs) -> torch.Tensor:
        return pipe(prompt="a red circle", height=64, width=64, num_inference_steps=2, guidance_scale=2.0,
                    generator=torch.Generator().manual_seed(0), output_type="pt", **kwargs).images

    toy = image(klein_pipe)
    assert torch.equal(toy, image(plain, max_sequence_length=TEXT_LENGTH))
    assert not torch.equal(toy, image(plain))  # 512 tokens draw another image
