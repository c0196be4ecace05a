"""The concept suite's command (issue 35.1, bench/concept_suite.py): a tiny slice runs end to end on the toy base and
writes its markdown table; each concept's codec floor is its own training images' measure after the VAE round trip."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench_scripts import load_bench
from stabletune_core.toy.score import circular_mean, hue_distance, judge
from stabletune_core.toy.world import BASE_COLORS, SHAPES, Scene, draw_scene

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def suite():
    return load_bench("concept_suite")


def test_the_suite_spans_the_hue_circle_and_unseen_shapes(suite):
    """At least six unseen colours, some between two base colours, and three shapes the base never drew, each
    with its own 12 drawn images that the toy judge reads as the concept."""
    from stabletune_core.toy.score import hue_of

    assert len(suite.SUITE_COLORS) >= 6 and len(suite.SUITE_SHAPES) >= 3
    hues = sorted(hue_of(rgb) for rgb in suite.SUITE_COLORS.values())
    gaps = [(b - a) for a, b in zip(hues, hues[1:] + [hues[0] + 360])]
    assert max(gaps) <= 90, hues  # spread around the circle
    known = {name: judge(draw_scene(Scene(name, "square", 1))).hue for name in BASE_COLORS}
    for name in suite.SUITE_COLORS:
        concept = suite.Concept(name)
        images = [draw_scene(scene) for scene in concept.scenes()]
        assert len(images) == 12 and {s.shape for s in concept.scenes()} == set(SHAPES)
        hue = circular_mean(judge(image).hue for image in images)
        assert min(hue_distance(hue, k) for k in known.values()) >= 20, (name, hue)  # not a colour the base knows
    for name in suite.SUITE_SHAPES:
        concept = suite.Concept(name)
        assert concept.kind == "shape" and name not in SHAPES
        assert all(judge(draw_scene(s), concept.prototypes()).shape == name for s in concept.scenes())
        assert concept.prompts() == [f"a {c} {name}" for c in BASE_COLORS]


def test_the_codec_floor_is_the_concept_measure_of_its_round_tripped_training_images(suite):
    """With a round trip that changes nothing, a colour's floor is its images' own scatter around their hue; one
    that redraws every image 20 degrees further round the circle adds 20; a shape's floor is the share still
    drawn as the shape."""
    import colorsys

    blue = suite.Concept("blue")
    scenes = blue.scenes()
    images = [draw_scene(s) for s in scenes]
    reference = circular_mean(judge(image).hue for image in images)
    scatter = sum(hue_distance(judge(image).hue, reference) for image in images) / len(images)
    assert suite.codec_floor(blue, images, lambda image: image) == pytest.approx(scatter)
    assert scatter < 3

    def shifted(scene: Scene, degrees: float) -> Scene:
        h, s, v = colorsys.rgb_to_hsv(*(c / 255 for c in scene.rgb))
        return Scene(scene.color, scene.shape, scene.seed,
                     rgb=tuple(round(c * 255) for c in colorsys.hsv_to_rgb((h + degrees / 360) % 1, s, v)))

    redrawn = {id(image): draw_scene(shifted(scene, 20)) for image, scene in zip(images, scenes)}
    assert suite.codec_floor(blue, images, lambda image: redrawn[id(image)]) == pytest.approx(20, abs=scatter + 1.5)

    cross = suite.Concept("cross")
    drawn = [draw_scene(s) for s in cross.scenes()]
    assert suite.codec_floor(cross, drawn, lambda image: image) == 1.0
    as_circles = {id(image): draw_scene(Scene(s.color, "circle", s.seed)) for image, s in zip(drawn, cross.scenes())}
    assert suite.codec_floor(cross, drawn, lambda image: as_circles[id(image)]) == 0.0


def test_the_suite_command_runs_a_slice_and_writes_its_table(suite, tmp_path, toy_cache, toy_base):
    """One concept x one seed, 4 training steps, 1 render seed: the command writes a markdown table with the
    suite's columns, one row, and the codec floor the VAE round trip gives the concept's own training images."""
    out = tmp_path / "suite"
    env = {**os.environ, "STABLETUNE_CACHE": str(toy_cache), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "bench/concept_suite.py", "--out", str(out), "--concepts", "blue",
                           "--seeds", "1", "--steps", "4", "--render-seeds", "1"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (out / "table.md").read_text().splitlines()
    assert lines[0] == "| " + " | ".join(suite.COLUMNS) + " |" and len(lines) == 3
    cells = dict(zip(suite.COLUMNS, (c.strip() for c in lines[2].strip("|").split("|"))))
    assert (cells["concept"], cells["kind"], cells["seed"], cells["steps"]) == ("blue", "colour", "1", "4")
    assert cells["pass"] in ("pass", "no") and cells["base shapes"].endswith(" %")
    row = json.loads((out / "rows.jsonl").read_text().splitlines()[0])
    assert set(row["drift"]) == set(BASE_COLORS)
    assert [cells[f"drift {c}"] for c in BASE_COLORS] == [f"{row['drift'][c]:.1f}" for c in BASE_COLORS]
    # the floor, recomputed here: each training image through the toy base's VAE, its hue against theirs
    round_trip = suite.vae_round_trip(Path(toy_base))
    images = [draw_scene(s) for s in suite.Concept("blue").scenes()]
    reference = circular_mean(judge(image).hue for image in images)
    floor = sum(hue_distance(judge(round_trip(image)).hue, reference) for image in images) / len(images)
    assert row["codec_floor"] == pytest.approx(floor, abs=1e-3) and cells["codec floor"] == f"{floor:.1f} deg"
    assert (out / "runs" / "blue-seed1" / "output" / "blue_lora.safetensors").is_file()


def test_a_recipe_change_is_read_as_toml_and_a_bad_one_is_one_sentence(suite):
    assert suite.recipe_overrides(["learning_rate=2e-3", "train_text_encoder=false", 'unet_lora_targets=["to_k"]',
                                   "lr_scheduler=constant"]) == {
        "learning_rate": 2e-3, "train_text_encoder": False, "unet_lora_targets": ["to_k"], "lr_scheduler": "constant"}
    with pytest.raises(SystemExit, match="is not KEY=VALUE"):
        suite.recipe_overrides(["learning_rate"])


def test_a_recipe_is_measured_beside_the_shipped_one_in_the_same_folder(suite, tmp_path, toy_cache, toy_base):
    """`--prior` and `--set` change the recipe (issue 35.2: a recipe judged over the suite): the row records it,
    its run trains with it in its own folder, and the shipped recipe's row in the same OUT is kept."""
    out = tmp_path / "suite"
    env = {**os.environ, "STABLETUNE_CACHE": str(toy_cache), "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "bench/concept_suite.py", "--out", str(out), "--concepts", "teal", "--seeds", "1",
            "--steps", "2", "--render-seeds", "1"]
    for extra in ([], ["--prior", "1", "--set", "learning_rate=2e-3"]):
        done = subprocess.run(base + extra, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert [r["recipe"]["prior"] for r in rows] == [2, 1] and "learning_rate" not in rows[0]["recipe"]
    assert rows[1]["recipe"]["learning_rate"] == 2e-3 and rows[0]["recipe"]["base"] == rows[1]["recipe"]["base"]
    runs = sorted(p.name for p in (out / "runs").iterdir())
    assert runs[0] == "teal-seed1" and len(runs) == 2
    import tomllib

    trained = tomllib.loads((out / "runs" / runs[1] / "config.toml").read_text())
    assert trained["learning_rate"] == 2e-3 and Path(trained["train_data_dir"]).name == "teal-priors-1-" + \
        Path(trained["pretrained_model_name_or_path"]).name
    assert len(list((Path(trained["train_data_dir"]) / "1_known_colours").glob("*.png"))) == 12  # 1 a base prompt
    assert len(list((out / "data" / "teal" / "1_known_colours").glob("*.png"))) == 24
