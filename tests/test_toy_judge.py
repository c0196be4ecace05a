"""The toy judge measures in degrees and shapes (issue 21.1), on drawn images whose answers are known.

No model here: images are drawn by the toy world (world.py) with chosen hues, so each measure has an exact
expected value. The learning tests (test_toy_learning.py) use the same measures on generated images.
"""
from __future__ import annotations

import colorsys
import json
import re
from pathlib import Path

import pytest

from stabletune_core.toy.judge import (CONCEPT_PASS_DEG, KEPT_PASS_DEG, describe, judge_samples, learning_summary,
                                       passed)
from stabletune_core.toy.score import SHAPE_PROTOTYPES, circular_mean, hue_distance, judge
from stabletune_core.toy.world import (ALL_COLORS, ALL_SHAPES, BASE_COLORS, CONCEPT_COLOR, Scene, base_scenes,
                                       concept_scenes, draw_scene, write_dataset)


def rgb_at(hue: float, saturation: float = 0.8, value: float = 0.8) -> tuple[int, int, int]:
    r, g, b = colorsys.hsv_to_rgb((hue % 360) / 360, saturation, value)
    return round(r * 255), round(g * 255), round(b * 255)


def test_every_drawn_shape_is_judged_right_and_its_hue_within_two_degrees():
    scenes = base_scenes(240, seed=3) + concept_scenes(30) + [
        Scene(color, "ring", 7000 + i) for i, color in enumerate(list(ALL_COLORS) * 12)]
    for scene in scenes:
        verdict = judge(draw_scene(scene))
        assert verdict.shape == scene.shape, (scene, verdict)
        assert hue_distance(verdict.hue, judge(draw_scene(Scene(scene.color, "square", 1))).hue) <= 1.5, scene
    assert set(SHAPE_PROTOTYPES) == set(ALL_SHAPES)


def test_hue_distance_and_circular_mean_wrap_around_red():
    assert hue_distance(355, 5) == pytest.approx(10)
    assert hue_distance(10, float("nan")) == 180  # no object: as far off as can be
    assert circular_mean([350, 10]) == pytest.approx(0, abs=1e-6) or circular_mean([350, 10]) == pytest.approx(360)
    for hue in (0, 90, 200, 300):
        assert hue_distance(judge(draw_scene(Scene("any", "circle", 5, rgb=rgb_at(hue)))).hue, hue) <= 2.0  # PIL hue steps: 1.4 deg


def fake_run(tmp_path: Path, concept_hue: float, steps: dict[int, dict[str, float]], seeds=(7, 8)) -> Path:
    """A run folder as the engine leaves it: config.toml naming its dataset (12 concept images at
    `concept_hue`, 6 base-colour images), and RUN/samples/step_N/ with the hue each prompt was drawn in."""
    data = tmp_path / "data"
    concept = [Scene(CONCEPT_COLOR, s.shape, s.seed, rgb=rgb_at(concept_hue)) for s in concept_scenes(12)]
    write_dataset(data / f"1_{CONCEPT_COLOR}", concept)
    write_dataset(data / "1_known", base_scenes(6, seed=4))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(f'train_data_dir = "{data}"\ncaption_extension = ".txt"\n')
    for step, hues in steps.items():
        folder = run / "samples" / f"step_{step:06d}"
        folder.mkdir(parents=True)
        prompts = list(hues)
        (folder / "prompts.json").write_text(json.dumps({"prompts": prompts, "seeds": list(seeds)}))
        for p, prompt in enumerate(prompts):
            for seed in seeds:
                shape = prompt.split()[-1]
                draw_scene(Scene("any", shape, seed, rgb=rgb_at(hues[prompt]))).save(folder / f"p{p:02d}_s{seed}.png")
    return run


def test_concept_error_is_against_the_runs_training_images_and_drift_against_step0(tmp_path):
    red, green = 0.0, 128.0
    run = fake_run(tmp_path, concept_hue=281.0, steps={
        0: {"a purple circle": 200.0, "a red circle": red, "a green square": green},
        100: {"a purple circle": 286.0, "a red circle": red + 2.0, "a green square": green - 7.0}})
    first = judge_samples(run / "samples" / "step_000000")
    last = judge_samples(run / "samples" / "step_000100", run)
    # the reference is the training images' hue (281), not the palette's purple (273)
    assert first["concept"][CONCEPT_COLOR] == pytest.approx(81, abs=1.5)
    assert last["concept"][CONCEPT_COLOR] == pytest.approx(5, abs=1.5)
    assert first["drift"] == {"red": 0.0, "green": 0.0}
    assert last["drift"]["red"] == pytest.approx(2, abs=1.0) and last["drift"]["green"] == pytest.approx(7, abs=1.0)
    assert last["shapes"] == 1.0 and last["images"] == 6
    assert not passed(last)  # green moved more than KEPT_PASS_DEG
    assert KEPT_PASS_DEG < 7 and CONCEPT_PASS_DEG >= 5
    pattern = r"purple: (\d+) deg off -> (\d+) deg off; kept: red drift (\d+) deg, green drift (\d+) deg; shapes 100 %"
    line = re.fullmatch(pattern, describe(last, first))
    assert line, describe(last, first)
    for got, want in zip(map(int, line.groups()), (81, 5, 2, 7)):  # PIL's hue steps are 1.4 deg
        assert abs(got - want) <= 1.5, line.group(0)
    summary = learning_summary(run)
    assert re.match(pattern[:-len("; shapes 100 %")], summary), summary
    assert "not yet (concept within 8 deg of its training images, kept colours within 3 deg of the base)" in summary


KEPT_HUES = {"a red circle": 0.0, "a yellow triangle": 52.0, "a green square": 128.0, "a cyan circle": 186.0}


def test_a_run_that_kept_its_colours_and_learned_the_concept_passes(tmp_path):
    run = fake_run(tmp_path, concept_hue=274.0, steps={
        0: {"a purple square": 10.0, **KEPT_HUES},
        50: {"a purple square": 270.0, **KEPT_HUES, "a cyan circle": 187.0}})
    assert learning_summary(run).endswith("; read 10 images at step 50 against step 0's; pass (concept within 8 deg "
                                          "of its training images, kept colours within 3 deg of the base)")


def test_the_summary_never_passes_a_kept_colour_it_did_not_measure(tmp_path):
    """Issue 35.3: validation prompts that name only some of the base's colours measure only those: the summary
    names the others as not measured instead of saying 'pass' about them."""
    run = fake_run(tmp_path, concept_hue=274.0, steps={
        0: {"a purple square": 10.0, "a cyan circle": 186.0},
        50: {"a purple square": 270.0, "a cyan circle": 187.0}})
    summary = learning_summary(run)
    assert "pass" not in summary, summary
    assert summary.endswith("; no verdict: not measured: red, yellow, green drift (no validation image with a step-0 "
                            "image to compare)"), summary


def test_a_resume_that_lost_step_0s_images_says_what_it_could_not_measure(tmp_path):
    """Issue 35.3: images whose step-0 image is gone are counted as not measured; a colour left without any is not
    passed; a run without its step-0 sampling has no drift at all and says so."""
    steps = {0: {"a purple square": 10.0, **KEPT_HUES}, 50: {"a purple square": 270.0, **KEPT_HUES}}
    run = fake_run(tmp_path / "part", concept_hue=274.0, steps=steps)
    (run / "samples" / "step_000000" / "p01_s8.png").unlink()  # one of red's two step-0 images
    summary = learning_summary(run)
    assert "read 10 images at step 50 against step 0's (1 without their step-0 image, not measured); pass (" in summary
    for seed in (7, 8):  # every step-0 image of green
        (run / "samples" / "step_000000" / f"p03_s{seed}.png").unlink()
    summary = learning_summary(run)
    assert "(3 without their step-0 image, not measured); no verdict: not measured: green drift" in summary, summary
    lost = fake_run(tmp_path / "lost", concept_hue=274.0, steps=steps)
    for path in (lost / "samples" / "step_000000").iterdir():
        path.unlink()
    (lost / "samples" / "step_000000").rmdir()
    summary = learning_summary(lost)
    assert summary.endswith("; read 10 images at step 50; no verdict: the base's own images (step 0) are missing, so "
                            "no kept colour's drift was measured"), summary


def test_a_run_shorter_than_one_sampling_interval_has_no_verdict(tmp_path):
    """Issue 35.3: with only step 0's images (the base's own), first and last are the same sampling: nothing the
    run learned was measured, and drift 0 against itself is no pass."""
    run = fake_run(tmp_path, concept_hue=274.0, steps={0: {"a purple square": 272.0, **KEPT_HUES}})
    summary = learning_summary(run)
    assert "pass" not in summary
    assert summary.endswith("; read 10 images at step 0 only; no verdict: the run made no validation images after "
                            "step 0 (it ended before its first sampling), so nothing it learned was measured"), summary


def test_a_shape_drawn_wrong_counts_against_shapes(tmp_path):
    run = fake_run(tmp_path, concept_hue=274.0, steps={0: {"a red circle": 0.0}})
    folder = run / "samples" / "step_000000"
    draw_scene(Scene("red", "square", 3)).save(folder / "p00_s7.png")  # asked for a circle
    assert judge_samples(folder)["shapes"] == 0.5
    assert set(BASE_COLORS) >= {"red", "green", "cyan"}


def test_a_concept_shape_is_measured_by_how_many_images_show_it(tmp_path):
    """Issue 21.3: 'a red ring' (a shape the base never drew, in a colour it knows) counts as drawn right only
    when the image shows a ring; the base prompts still report drift and shapes."""
    run = fake_run(tmp_path, concept_hue=274.0, steps={0: {"a red ring": 0.0, "a green square": 128.0},
                                                       100: {"a red ring": 0.0, "a green square": 128.0}})
    for seed in (7, 8):  # at step 0 the base draws a red circle for "a red ring"
        draw_scene(Scene("red", "circle", seed)).save(run / "samples" / "step_000000" / f"p00_s{seed}.png")
    first = judge_samples(run / "samples" / "step_000000")
    last = judge_samples(run / "samples" / "step_000100")
    assert first["concept_shapes"] == {"ring": 0.0} and last["concept_shapes"] == {"ring": 1.0}
    assert last["concept"] == {} and last["drift"] == {"green": 0.0} and last["shapes"] == 1.0
    assert learning_summary(run) == ("ring: 0 % -> 100 % drawn as a ring; kept: green drift 0 deg; shapes 100 %; "
                                     "read 4 images at step 100 against step 0's; no verdict: not measured: red, "
                                     "yellow, cyan drift (no validation image with a step-0 image to compare)")


def test_an_unknown_demo_concept_is_one_sentence_before_anything_is_built(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "STABLETUNE_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "stabletune_core", "demo", "--concept", "star", "--output_dir",
                           str(tmp_path / "run")], cwd=Path(__file__).resolve().parent.parent, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: The demo has no concept 'star': choose 'colour' (the toy base learns "
                                   "purple) or 'shape' (it learns to draw rings).")
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()  # nothing built, nothing loaded


def test_the_shape_concept_trains_with_its_own_preset():
    """Issue 21.3: a shape is structure, not tint: `demo --concept shape` on the SD toy base reads
    presets/demo-shape.toml (a higher UNet rate and more steps than the colour demo's preset, which drew rings for
    12.5 % of the ring prompts' images); the colour demo and a family without a shape preset keep their own."""
    from stabletune_core.config import read_toml
    from stabletune_core.demo import demo_preset
    from stabletune_core.toy.bases import TOY_BASES

    shape, colour = demo_preset("shape", "sd1"), demo_preset("colour", "sd1")
    assert (shape.name, colour.name) == ("demo-shape.toml", TOY_BASES["sd1"].preset)
    assert demo_preset("shape", "flux2_klein").name == TOY_BASES["flux2_klein"].preset
    shape_values, colour_values = read_toml(shape), read_toml(colour)
    assert shape_values["learning_rate"] > colour_values["learning_rate"]
    assert shape_values["max_train_steps"] > colour_values["max_train_steps"]
