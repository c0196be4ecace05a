"""The toy SD 1.x base's codec carries the whole hue circle (issue 35.1): a drawn shape of any hue comes back from a
VAE encode-decode round trip within a few degrees, so no concept colour is out of a LoRA's reach before training."""
from __future__ import annotations

import pytest

from bench_scripts import load_bench
from stabletune_core.toy.codec import (HUE_STEP, edge_band, hue_circle_floor, hue_scenes, reconstruction_loss,
                                       round_trip, shape_keeping)
from stabletune_core.toy.score import hue_distance, judge
from stabletune_core.toy.world import draw_scene

WORST_HUE_DEG = 3.0  # the "within a couple of degrees", at every hue in 10-degree steps
SHAPES_KEPT = 0.9  # per base colour and shape: the base's denoiser must draw 99 % of its shapes right through it


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


def test_the_shipped_codec_gives_back_every_base_shape(shipped_vae):
    """A codec that carries every hue but rounds squares off is no base: its denoiser drew 86.5 % of the base shapes
    right (cyan squares 0 %) where v3's draws 100 % (bench/RESULTS.md)."""
    kept = shape_keeping(round_trip(shipped_vae))
    assert min(kept.values()) >= SHAPES_KEPT, kept
    assert shape_keeping(lambda image: image)["green square"] == 1.0  # the measure reads drawn shapes right


def test_the_edge_term_weighs_the_outline_of_the_object():
    import torch

    x = torch.full((1, 3, 16, 16), 0.8)
    x[:, :, 4:12, 4:12] = torch.tensor([-0.7, 0.3, -0.6]).view(1, 3, 1, 1)  # a green square on a pale ground
    saturated = ((x.amax(1, keepdim=True) - x.amin(1, keepdim=True)) > 0.5).float()
    band = edge_band(saturated)[0, 0]
    assert band[8, 8] == 0 and band[0, 0] == 0 and band[4, 4] == 1 and band[2, 8] == 1 and band[5, 8] == 1
    corner, centre = torch.zeros_like(x), torch.zeros_like(x)
    corner[:, :, 4, 4], centre[:, :, 8, 8] = 0.5, 0.5  # the same error on a corner pixel and a central one
    assert reconstruction_loss(x, corner) == reconstruction_loss(x, centre)
    assert reconstruction_loss(x, corner, edge_weight=16) > 2 * reconstruction_loss(x, centre, edge_weight=16)


def test_the_bench_table_has_a_row_per_hue_and_the_suite_colours():
    bench = load_bench("codec_floor")
    hues = {h: float(h % 7) for h in range(0, 360, HUE_STEP)}
    text = bench.table({"before": (hues, {"orange": 24.8}), "after": ({h: 1.0 for h in hues}, {"orange": 1.2})})
    lines = text.splitlines()
    assert lines[0] == "| hue | before | after |"
    assert "| 30 | 2.0 | 1.0 |" in lines and "| orange (suite) | 24.8 | 1.2 |" in lines
    assert "| worst hue | 6.0 | 1.0 |" in lines
