"""Issue 35.5: a judge for any run. The perceptual-drift observer records, at every sampling, each prompt's drift
from the base's own step-0 image (same prompt and seed) and each concept prompt's distance to the nearest training
image, in RUN/diagnostics/perceptual_drift.jsonl; the run's summary uses it when no sample judge applies; the
Samples tab charts it from the run folder."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest


def _dataset(root: Path) -> Path:
    """Kohya folders: 1_purple (the concept, 4 images) and 1_known (red shapes the base is to keep drawing)."""
    from stabletune_core.demo import draw_shape

    rng = random.Random(0)
    for folder, color, rgb in (("1_purple", "purple", (130, 40, 170)), ("1_known", "red", (220, 40, 40))):
        (root / folder).mkdir(parents=True)
        for i, shape in enumerate(("circle", "square", "circle", "square")):
            draw_shape(shape, rgb, 64, rng).save(root / folder / f"{i}.png")
            (root / folder / f"{i}.txt").write_text(f"a {color} {shape}")
    return root


def test_concept_words_are_the_kohya_folder_names_the_captions_use_else_the_common_words(tmp_path):
    from stabletune_core.train.observers.perceptual_drift import concept_words

    data = _dataset(tmp_path / "data")
    captions = [p.read_text() for p in sorted(data.rglob("*.txt"))]
    assert concept_words(data, captions) == ["purple"]  # "known" names a folder but no caption
    trigger = ["a photo of sks dog", "sks dog on grass", "a photo of sks dog sleeping", "a cat"]
    assert concept_words(None, trigger) == ["dog", "sks"]  # "a", "photo", "of" are no concept


@pytest.fixture(scope="module")
def drift_run(small_config, tiny_model, tmp_path_factory):
    """One real run on the tiny SD 1.x (sample_judge none), shared by the tests that read it."""
    import torch

    from stabletune_core.train.loop import train

    root = tmp_path_factory.mktemp("drift")
    config = small_config(tiny_model, root / "run", train_data_dir=str(_dataset(root / "data")), max_train_steps=4,
                          learning_rate=2e-2, validation_steps=2, validation_prompt="a purple circle | a red circle",
                          num_validation_images=2, validation_inference_steps=2, validation_loss_every=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model is dispatch-bound (conftest one_thread)
    try:
        train(config)
    finally:
        torch.set_num_threads(threads)
    return root / "run"


def test_every_sampling_is_recorded_against_step_0_and_the_training_images(drift_run):
    from stabletune_core.train.observers.perceptual_drift import VAE_MEASURE, read_records

    records = read_records(drift_run / "diagnostics" / "perceptual_drift.jsonl")
    assert [r["step"] for r in records] == [0, 2, 4]
    assert all(r["measure"] == VAE_MEASURE for r in records)  # no LPIPS backbone weights on this machine
    assert records[0]["concept"] == ["a purple circle"] and records[0]["kept"] == ["a red circle"]
    assert all(v == 0 for prompt in records[0]["drift"].values() for v in prompt["seeds"].values())
    last = records[-1]
    assert set(last["drift"]) == {"a purple circle", "a red circle"} and set(last["drift"]["a red circle"]["seeds"]) \
        == {"3", "4"}
    assert last["drift"]["a purple circle"]["mean"] > 0  # the LoRA moved the images
    assert set(last["nearest"]) == {"a purple circle"} and last["nearest"]["a purple circle"]["mean"] > 0
    assert last["images"] == 4 and last["unpaired"] == 0


def test_the_summary_uses_the_drift_when_no_judge_applies(drift_run):
    summary = json.loads((drift_run / "status.json").read_text())["summary"]
    assert summary.startswith("Learning summary (distances in the model's own VAE latent space"), summary
    assert "kept prompts drift" in summary and "'a red circle'" in summary
    assert "from the nearest training image" in summary and "read 4 images at step 4 against step 0's" in summary


def test_the_samples_tab_charts_drift_per_kept_prompt_and_concept_distance_over_steps(drift_run):
    from extension.tabs.samples import drift_frames, drift_note

    kept, concept = drift_frames(drift_run)
    assert set(kept["series"]) == {"a red circle"} and list(kept["step"]) == [0, 2, 4]
    assert set(concept["series"]) == {"a purple circle"} and list(concept["step"]) == [0, 2, 4]
    assert kept["value"].iloc[0] == 0
    assert "VAE latent" in drift_note(drift_run) and "step 4, 4 images read" in drift_note(drift_run)


def test_the_samples_tab_refresh_sends_the_charts_once_a_record_lands(drift_run):
    from extension.compat import unchanged
    from extension.tabs.samples import DRIFT_OUTPUTS, _refresh_drift

    seen: dict = {}
    note, kept, concept = _refresh_drift(seen, drift_run)
    assert len(DRIFT_OUTPUTS) == 3 and "Perceptual drift" in note
    assert set(kept["series"]) == {"a red circle"} and set(concept["series"]) == {"a purple circle"}
    assert _refresh_drift(seen, drift_run) == [unchanged()] * 3  # nothing new: nothing re-sent


def test_the_summary_says_what_is_missing_without_step_0():
    from stabletune_core.train.observers.perceptual_drift import drift_summary

    record = {"step": 200, "measure": "vae_latent", "concept_words": [], "kept": ["a cat"], "concept": [],
              "drift": {}, "nearest": {}, "images": 2, "unpaired": 2}
    assert "the base's own images (step 0) are missing" in drift_summary([record])
