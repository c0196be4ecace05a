"""The toy SD 1.x base's codec carries the whole hue circle (issue 35.1): a drawn shape of any hue comes back from a
VAE encode-decode round trip within a few degrees, so no concept colour is out of a LoRA's reach before training."""
from __future__ import annotations

import pytest

from bench_scripts import load_bench
from stabletune_core.toy.codec import HUE_STEP, hue_circle_floor, hue_scenes, round_trip
from stabletune_core.toy.score import hue_distance, judge
from stabletune_core.toy.world import draw_scene

WORST_HUE_DEG = 3.0  # the "within a couple of degrees", at every hue in 10-degree steps


@pytest.fixture(scope="module")
def shipped_vae(toy_base):
    import torch
    from diffusers import AutoencoderKL

    torch.set_num_threads(1)
    return AutoencoderKL.from_pretrained(str(toy_base / "vae"), local_files_only=True).eval()


def test_the_measure_draws_each_hue_and_reads_zero_for_a_perfect_codec():
    for hue in (0, 90, 200, 310):
        images = [draw_scene(scene) for scene in hue_scenes(hue)]
        assert all(hue_distance(judge(image).hue, hue) < 4 for image in images)
    assert set(hue_circle_floor(lambda image: image)) == set(range(0, 360, HUE_STEP))
    assert max(hue_circle_floor(lambda image: image).values()) == 0.0
    # a codec that turns every image's colour to one fixed red is far off at every hue but red's
    from PIL import Image

    red = lambda image: Image.new("RGB", image.size, (215, 35, 35))  # noqa: E731
    assert hue_circle_floor(red)[180] > 150


@pytest.mark.xfail(strict=True, reason="issue 35.1: the shipped toy SD base's encoder collapses hues between its "
                   "palette's (worst 75 deg at hue 110, bench/RESULTS.md); passes once the base is rebuilt")
def test_the_shipped_codec_carries_every_hue_within_three_degrees(shipped_vae):
    floor = hue_circle_floor(round_trip(shipped_vae))
    worst = max(floor, key=floor.get)
    assert floor[worst] <= WORST_HUE_DEG, f"hue {worst} comes back {floor[worst]:.1f} deg off"


def test_the_bench_table_has_a_row_per_hue_and_the_suite_colours():
    bench = load_bench("codec_floor")
    hues = {h: float(h % 7) for h in range(0, 360, HUE_STEP)}
    text = bench.table({"before": (hues, {"orange": 24.8}), "after": ({h: 1.0 for h in hues}, {"orange": 1.2})})
    lines = text.splitlines()
    assert lines[0] == "| hue | before | after |"
    assert "| 30 | 2.0 | 1.0 |" in lines and "| orange (suite) | 24.8 | 1.2 |" in lines
    assert "| worst hue | 6.0 | 1.0 |" in lines
