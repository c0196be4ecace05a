"""Learning you can see on FLUX.2 Klein (issue 23 item 5): the shipped toy Klein base draws the toy world it was
trained on, and `demo --family flux2_klein` teaches it the held-out colour, measured as the SD 1.x demo is.

Every claim is a measure on generated images, in units (toy/score.py), over 8 seeds per prompt: the concept's hue
error against the run's own training images, each kept colour's drift against the base's own image at the same
prompt and seed, shapes right in percent. The demo runs once per module, exactly as a user runs it.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stabletune_core.toy.evaluate import SCORE_SEEDS, learning_report, mean, render, scores
from stabletune_core.toy.judge import concept_reference, judge_samples, passed, sample_folders
from stabletune_core.toy.world import BASE_COLORS, CONCEPT_COLOR, base_prompts, concept_prompts

ROOT = Path(__file__).resolve().parent.parent
SEEDS = SCORE_SEEDS  # 8 seeds per prompt
#: Issue 23.5's targets, the SD demo's (tests/test_toy_learning.py), over 8 seeds per prompt. Measured on the v3
#: base (build manifest): right 94 %, shapes 97 %; its demo (presets/demo-flux2-klein.toml, kleindemo report):
#: purple 6.8 deg off, worst drift 2.7 deg (green), shapes 96 %.
BASE_RIGHT_MIN = 0.90  # right colour (within 6 deg of the palette) and right shape
CONCEPT_BEFORE_MIN_DEG = 30.0  # the base never saw purple
CONCEPT_AFTER_MAX_DEG = 8.0  # purple within 8 deg of the run's own training images
DRIFT_MAX_DEG = 3.0  # every base colour within 3 deg of the base's own image at the same prompt and seed
SHAPES_MIN = 0.90


def run_cli(*args: str, cache: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "STABLETUNE_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


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
    return render(klein_pipe, base_prompts() + concept_prompts(), SEEDS)


# Not slow: its 96 + 24 base images (39 s at load 6, one thread) are the ones the demo test's drift reads anyway.
def test_the_toy_klein_base_draws_the_colour_and_shape_it_is_asked_for(base_images, one_thread):
    """Right colour (within 6 degrees of the palette) and right shape for most of the base prompts' images over 8
    seeds (evaluate.base_report's measures); the concept colour, never seen, is far off."""
    from stabletune_core.toy.evaluate import concept_reference_hue

    base = scores({p: base_images[p] for p in base_prompts()})
    right = mean(p["right"] for p in base.values())
    concept = scores({p: base_images[p] for p in concept_prompts()}, {CONCEPT_COLOR: concept_reference_hue()})
    assert right >= BASE_RIGHT_MIN, base
    assert mean(p["hue_error"] for p in concept.values()) >= CONCEPT_BEFORE_MIN_DEG, concept


@pytest.fixture(scope="module")
def klein_demo(tmp_path_factory, toy_cache):
    """`demo --family flux2_klein`, run as a user runs it; returns (run dir, console output)."""
    run = tmp_path_factory.mktemp("klein-demo") / "demo"
    done = run_cli("stabletune_core", "demo", "--family", "flux2_klein", "--output_dir", str(run), cache=toy_cache)
    assert done.returncode == 0, done.stderr[-3000:]
    return run, done.stdout + done.stderr


@pytest.fixture(scope="module")
def klein_lora_pipe(klein_demo, klein_base):
    """A fresh Flux2KleinPipeline of the toy Klein with the demo's exported LoRA, loaded as a user would."""
    from stabletune_core.toy.klein import load_toy_klein_pipeline

    run, _ = klein_demo
    lora = run / "output" / "demo_klein_lora.safetensors"
    pipe = load_toy_klein_pipeline(klein_base)
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name, adapter_name="demo")
    return pipe


# Not slow: 2 min 40 s at load 6 on one thread with the base images above (the demo as a user runs it, toy base and
# prior images included, 80 s; the LoRA's 120 images 43 s), under the ~4 minutes a slow mark is for.
def test_demo_teaches_the_toy_klein_the_concept_and_keeps_its_colours(klein_demo, base_images, klein_lora_pipe,
                                                                       one_thread):
    """`demo --family flux2_klein` ends with purple close to its training images and the base colours kept,
    measured on 8 seeds with the exported LoRA in diffusers' own pipeline; the run says it in degrees."""
    run, console = klein_demo
    tuned = render(klein_lora_pipe, base_prompts() + concept_prompts(), SEEDS)
    report = learning_report(base_images, tuned, concept_reference(run, CONCEPT_COLOR))
    print(f"toy Klein demo, 8 seeds per prompt: {report}")
    assert report["concept_before"] >= CONCEPT_BEFORE_MIN_DEG, report
    assert report["concept_after"] <= CONCEPT_AFTER_MAX_DEG, report
    assert max(report["drift"].values()) <= DRIFT_MAX_DEG, report
    assert report["shapes"] >= SHAPES_MIN, report
    kept = "kept: " + ", ".join(rf"{color} drift (\d+) deg" for color in BASE_COLORS)  # issue 35.3: every one
    line = re.search(rf"Learning summary.*: {CONCEPT_COLOR}: (\d+) deg off -> (\d+) deg off; {kept}; shapes (\d+) %",
                     console)
    assert line, console[-2000:]
    first, last = int(line.group(1)), int(line.group(2))
    assert first >= CONCEPT_BEFORE_MIN_DEG and last < first, line.group(0)


def test_the_klein_demos_own_summary_passes_at_its_validation_seeds(klein_demo):
    """What the user reads: the run's own summary, on its validation prompts and seeds (2 per prompt), meets the
    targets too, not only the 8-seed measure (it read red 4 / green 4 deg, 'not yet', with 2 prior images per
    base prompt)."""
    run, console = klein_demo
    last = judge_samples(sample_folders(run)[-1], run)
    assert last["concept"][CONCEPT_COLOR] <= CONCEPT_AFTER_MAX_DEG, last
    assert max(last["drift"].values()) <= DRIFT_MAX_DEG and last["shapes"] >= SHAPES_MIN, last
    assert passed(last) and re.search(r"Learning summary.*; pass \(", console), console[-2000:]


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
