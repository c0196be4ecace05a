"""Issue 35.3: the run's last sampling draws final_validation_images seeds a prompt (and the base's images at the
extra seeds into step 0's folder), so the learning summary reads more images and says how many; the samplings
before keep their seeds and the LoRA is bitwise the one of a run without the extra seeds."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file

PROMPTS = "a red circle | a blue square"


def _run(small_config, tiny_model: Path, output: Path, **overrides) -> Path:
    from stabletune_core.train.loop import train

    values = dict(max_train_steps=4, learning_rate=1e-2, validation_steps=2, validation_prompt=PROMPTS,
                  num_validation_images=1, validation_inference_steps=2, validation_loss_every=0,
                  sample_judge="toy_colors")
    values.update(overrides)
    return train(small_config(tiny_model, output, **values))


def _seeds(run: Path, step: int) -> list[int]:
    return json.loads((run / "samples" / f"step_{step:06d}" / "prompts.json").read_text())["seeds"]


def _pixels(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"), dtype=np.int16)


def test_the_final_sampling_has_the_extra_seeds_and_training_is_unchanged(small_config, tiny_model, tmp_path,
                                                                           one_thread):
    extra = _run(small_config, tiny_model, tmp_path / "extra", final_validation_images=3)
    run = tmp_path / "extra"
    assert _seeds(run, 2) == [3]  # the samplings before the last keep num_validation_images seeds
    assert _seeds(run, 4) == [3, 4, 5] and len(list((run / "samples" / "step_000004").glob("*.png"))) == 6
    assert _seeds(run, 0) == [3, 4, 5] and len(list((run / "samples" / "step_000000").glob("*.png"))) == 6

    plain = _run(small_config, tiny_model, tmp_path / "plain")
    a, b = load_file(extra), load_file(plain)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the extra seeds changed training"
    # the base's images at the extra seeds are the base's: a run asking 3 seeds at every sampling drew them at
    # step 0 (one image a call there, a prompt's seeds in one call here: up to one 8-bit level apart)
    three = tmp_path / "three"
    _run(small_config, tiny_model, three, num_validation_images=3)
    for name in ("p00_s4.png", "p01_s5.png"):
        step0 = Path("samples") / "step_000000" / name
        assert np.abs(_pixels(run / step0) - _pixels(three / step0)).max() <= 1
    assert (run / "samples" / "step_000000" / "p00_s3.png").read_bytes() == \
        (tmp_path / "plain" / "samples" / "step_000000" / "p00_s3.png").read_bytes()

    from stabletune_core.demo import make_gallery

    with Image.open(make_gallery(run)) as sheet:  # a row per prompt x seed that every sampling drew: 2, not 6
        assert sheet.height < 18 + 3 * (64 * 2 + 4), sheet.height


def test_the_summary_reads_the_final_samplings_images_and_says_how_many(small_config, tiny_model, tmp_path,
                                                                         one_thread):
    _run(small_config, tiny_model, tmp_path / "run", final_validation_images=4)
    summary = json.loads((tmp_path / "run" / "status.json").read_text())["summary"]
    assert "read 8 images at step 4 against step 0's" in summary, summary  # 2 prompts x 4 seeds, all paired
    assert "without their step-0 image" not in summary


def test_the_demo_asks_8_seeds_at_its_last_sampling():
    from stabletune_core.config import read_toml
    from stabletune_core.demo import PRESETS

    assert read_toml(PRESETS / "demo.toml")["final_validation_images"] == 8
