"""Learning you can see: the toy base draws what it is asked, and the demo's LoRA teaches it a new colour.

Every claim here is a measure on generated images, in units (toy/score.py: the hue of the drawn object in
degrees, its shape), over 8 seeds per prompt, not a loss: the concept's hue error against the run's own
training images, each kept colour's drift against the base model's own image at the same prompt and seed.
The demo runs once per module, exactly as a user runs it (`python -m stabletune_core demo`).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stabletune_core.toy.evaluate import SCORE_SEEDS, base_report, drift, mean, render, scores
from stabletune_core.toy.judge import concept_reference
from stabletune_core.toy.world import BASE_COLORS, CONCEPT_COLOR, base_prompts, concept_prompts

ROOT = Path(__file__).resolve().parent.parent
SEEDS = SCORE_SEEDS  # 8 seeds per prompt
CONCEPT_MAX_DEG = 8.0  # issue 21.4: the demo's concept within 8 degrees of its training images
DRIFT_MAX_DEG = 3.0  # issue 21.4: every base colour within 3 degrees of the base's own images
#: LoHa/LoKr at their demo rates, in the run's own view (2 seeds per prompt): kept colours stay nearer their
#: own hue than any other palette colour (the palette's neighbours are 50-90 degrees apart), what the test
#: asserted before it spoke in degrees; the tight 3-degree bound is the LoRA demo's (issue 21.4).
LYCORIS_DRIFT_MAX_DEG = 30.0
#: The summary's kept colours: every base colour, each over every shape of its validation prompts (issue 35.3).
KEPT_PATTERN = "kept: " + ", ".join(rf"{color} drift (\d+) deg" for color in BASE_COLORS)


@pytest.fixture(scope="module")
def toy_pipe(toy_base):
    from stabletune_core.toy import load_toy_pipeline

    return load_toy_pipeline(toy_base)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, toy_cache):
    """The demo, run as a user runs it; returns (run dir, console output)."""
    run = tmp_path_factory.mktemp("demo") / "demo"
    env = {**os.environ, "STABLETUNE_CACHE": str(toy_cache), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "stabletune_core", "demo", "--output_dir", str(run)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return run, done.stdout + done.stderr


@pytest.fixture(scope="module")
def lora_pipe(demo_run, toy_base):
    """A fresh diffusers pipeline of the toy base with the demo's exported LoRA, loaded as a user would."""
    from stabletune_core.toy import load_toy_pipeline

    run, _ = demo_run
    lora = run / "output" / "demo_lora.safetensors"
    pipe = load_toy_pipeline(toy_base)
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name, adapter_name="demo")
    return pipe


def concept_error(pipe, reference: float) -> float:
    """Mean hue error in degrees of the concept prompts' images (8 seeds each) against `reference`."""
    return mean(p["hue_error"] for p in scores(render(pipe, concept_prompts(), SEEDS),
                                               {CONCEPT_COLOR: reference}).values())


def drift_by_colour(base_pipe, tuned_pipe) -> dict[str, float]:
    """Per base colour: the mean drift in degrees of its prompts' images (every shape, 8 seeds)."""
    moved = drift(render(base_pipe, base_prompts(), SEEDS), render(tuned_pipe, base_prompts(), SEEDS))
    return {color: mean(v for p, v in moved.items() if p.split()[-2] == color) for color in BASE_COLORS}


def test_toy_base_draws_the_colour_and_shape_it_is_asked_for(toy_pipe, one_thread):
    """Issue 21.2: right colour (within 6 degrees of the palette) and right shape for >= 95 % of the base
    prompts' images over 8 seeds; the concept colour, never seen, is far off."""
    report = base_report(toy_pipe)
    assert len(report["seeds"]) >= 8
    assert report["base_right"] >= 0.95, report
    assert report["concept_hue_error"] >= 30, report  # it has never seen the concept colour


def test_render_draws_a_prompts_seeds_in_one_batch_each_as_it_is_drawn_alone(toy_pipe, one_thread):
    """Every measure here renders 8 seeds a prompt: one pipeline call a prompt, each image from its own seed's
    generator, so an image is what that seed draws alone (up to one 8-bit level), its hue and shape the same."""
    import numpy as np

    from stabletune_core.toy.score import hue_distance, judge

    calls = []

    def counted(**kwargs):
        calls.append(kwargs)
        return toy_pipe(**kwargs)

    prompts, seeds = base_prompts()[:2], SEEDS[:4]
    together = render(counted, prompts, seeds)
    assert len(calls) == len(prompts) and {c["num_images_per_prompt"] for c in calls} == {len(seeds)}
    for prompt in prompts:
        for seed, image in zip(seeds, together[prompt]):
            alone = render(toy_pipe, [prompt], [seed])[prompt][0]
            assert np.abs(np.asarray(image, dtype=int) - np.asarray(alone, dtype=int)).max() <= 1
            seen_together, seen_alone = judge(image), judge(alone)
            assert hue_distance(seen_together.hue, seen_alone.hue) <= 0.5
            assert seen_together.shape == seen_alone.shape


def test_demo_teaches_the_concept_without_wrecking_the_base(demo_run, toy_pipe, lora_pipe, one_thread):
    """Issue 21.4: the demo's defaults end with the concept within 8 degrees of its training images and every
    base colour within 3 degrees of the base's own images, measured on 8 seeds."""
    run, console = demo_run
    reference = concept_reference(run, CONCEPT_COLOR)
    before, after = concept_error(toy_pipe, reference), concept_error(lora_pipe, reference)
    assert before >= 30 and after <= CONCEPT_MAX_DEG, (before, after)
    moved = drift_by_colour(toy_pipe, lora_pipe)
    assert max(moved.values()) <= DRIFT_MAX_DEG, moved
    assert mean(p["shape"] for p in scores(render(lora_pipe, base_prompts(), SEEDS)).values()) >= 0.90
    # The run says what it learned, in degrees, in one line on the console, in status.json and in its events.
    line = re.search(rf"Learning summary.*: {CONCEPT_COLOR}: (\d+) deg off -> (\d+) deg off; {KEPT_PATTERN}; "
                     r"shapes (\d+) %", console)
    assert line, console[-2000:]
    first, last, *kept, shapes = (int(g) for g in line.groups())
    assert first >= 30 and last <= CONCEPT_MAX_DEG + 2, line.group(0)  # 2 seeds per prompt in the run's own view
    assert "% ->" not in console  # the closed-set "purple 0 % -> 100 %" wording is gone


def test_exported_lora_draws_what_the_engine_drew(demo_run, lora_pipe, one_thread):
    """The validation images the engine drew at the last step (its own model, in-process) and the same prompts
    and seeds drawn by diffusers from the exported file show the same hues and shapes."""
    import json

    from PIL import Image

    from stabletune_core.config import TrainConfig
    from stabletune_core.toy.score import hue_distance, judge

    run, _ = demo_run
    config = TrainConfig.from_toml(run / "config.toml")
    last = sorted((run / "samples").glob("step_*"))[-1]
    meta = json.loads((last / "prompts.json").read_text())
    from diffusers import DDIMScheduler

    lora_pipe.scheduler = DDIMScheduler.from_config(lora_pipe.scheduler.config)
    drawn = render(lora_pipe, meta["prompts"], meta["seeds"], steps=config.validation_inference_steps,
                   guidance=config.validation_guidance_scale, size=config.resolution)
    differences, same_shape = [], []
    for p, prompt in enumerate(meta["prompts"]):
        for seed, theirs in zip(meta["seeds"], drawn[prompt]):
            with Image.open(last / f"p{p:02d}_s{seed}.png") as image:
                ours = judge(image)
            differences.append(hue_distance(ours.hue, judge(theirs).hue))
            same_shape.append(ours.shape == judge(theirs).shape)
    assert max(differences) <= 3.0 and mean(differences) <= 1.0, differences
    assert mean(same_shape) >= 0.9, same_shape  # a blob between circle and square may tip either way


def test_lora_scale_moves_the_concept_error_monotonically(demo_run, lora_pipe, one_thread):
    reference = concept_reference(demo_run[0], CONCEPT_COLOR)
    values = []
    for scale in (0.0, 0.5, 1.0):
        lora_pipe.set_adapters(["demo"], adapter_weights=[scale])
        values.append(concept_error(lora_pipe, reference))
    lora_pipe.set_adapters(["demo"], adapter_weights=[1.0])
    assert values[0] >= values[1] >= values[2] and values[0] > values[2], values


@pytest.mark.parametrize("network_type", ["loha", "lokr"])
def test_the_demo_teaches_loha_and_lokr_at_the_rates_they_need(network_type, tmp_path, toy_cache):
    """LoHa and LoKr learn too little at LoRA's rate; the demo gives them their own (config.TOY_DEMO_RATES) and
    the run tells the user why, in one console line. Their learning summary, in degrees: the concept comes
    close and the kept colours stay."""
    run = tmp_path / "demo"
    env = {**os.environ, "STABLETUNE_CACHE": str(toy_cache), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "stabletune_core", "demo", "--output_dir", str(run),
                           "--network_type", network_type], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    console = done.stdout + done.stderr
    assert done.returncode == 0, console[-3000:]
    assert f"network_type {network_type} moves the weights less per step than LoRA" in console
    line = re.search(rf"Learning summary.*: {CONCEPT_COLOR}: (\d+) deg off -> (\d+) deg off; {KEPT_PATTERN}",
                     console)
    assert line, console[-2000:]
    before, after, *kept = (int(g) for g in line.groups())
    assert before >= 30 and after <= before / 2, line.group(0)  # the concept came at least halfway
    assert max(kept) <= LYCORIS_DRIFT_MAX_DEG, line.group(0)
    assert f'network_type = "{network_type}"' in (run / "config.toml").read_text()


def test_demo_shape_concept_learns_rings_and_keeps_the_base(tmp_path, toy_cache, toy_pipe, toy_base, one_thread):
    """Issue 21.3: `demo --concept shape` teaches the toy base a shape it never drew (a ring, in the colours it
    knows): >= 70 % of the ring prompts' images are rings (8 seeds), and the base keeps its colours (drift <= 3
    degrees each) and its shapes (>= 90 %). Structure, not tint. (The demo's shape preset, presets/demo-shape.toml:
    the colour preset drew rings for 12.5 % of these images.)"""
    from stabletune_core.toy import load_toy_pipeline
    from stabletune_core.toy.world import CONCEPT_SHAPE, shape_concept_prompts

    run = tmp_path / "demo-shape"
    env = {**os.environ, "STABLETUNE_CACHE": str(toy_cache), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "stabletune_core", "demo", "--concept", "shape", "--output_dir",
                           str(run)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    console = done.stdout + done.stderr
    assert done.returncode == 0, console[-3000:]
    assert "learns to draw rings" in console and "(1000 steps)" in console, console[:2000]
    line = re.search(rf"Learning summary.*: {CONCEPT_SHAPE}: (\d+) % -> (\d+) % drawn as a {CONCEPT_SHAPE}; "
                     rf"{KEPT_PATTERN}; shapes (\d+) %", console)
    assert line, console[-2000:]
    first, last, *kept, shapes = (int(g) for g in line.groups())
    # the run's own view: 2 seeds per prompt, so a coarser bound than the 8-seed measures below
    assert first <= 20 and last >= 50 and max(kept) <= DRIFT_MAX_DEG + 1 and shapes >= 75, line.group(0)
    pipe = load_toy_pipeline(toy_base)
    pipe.load_lora_weights(str(run / "output"), weight_name="demo_ring_lora.safetensors")
    before = mean(p["shape"] for p in scores(render(toy_pipe, shape_concept_prompts(), SEEDS)).values())
    after = mean(p["shape"] for p in scores(render(pipe, shape_concept_prompts(), SEEDS)).values())
    assert before <= 0.2 and after >= 0.70, (before, after)
    base_images, tuned_images = render(toy_pipe, base_prompts(), SEEDS), render(pipe, base_prompts(), SEEDS)
    moved = drift(base_images, tuned_images)
    by_colour = {c: mean(v for p, v in moved.items() if p.split()[-2] == c) for c in BASE_COLORS}
    assert max(by_colour.values()) <= DRIFT_MAX_DEG, by_colour
    assert mean(p["shape"] for p in scores(tuned_images).values()) >= 0.90
