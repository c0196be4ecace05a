"""What a run leaves in its folder tells the truth after a stop, a resume or a short run (issue 37, items 8, 12, 13):
the images a stopped run owed are made after its resume, an EMA file of earlier steps never sits beside a newer
LoRA under the name of the current one, and a run shorter than one sampling interval shows its LoRA."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from stabletune_core.lora.export import read_lora_metadata
from stabletune_core.runs.layout import RunPaths
from stabletune_core.runs.reader import RunReader

SAMPLING = dict(validation_steps=1000, validation_prompt="a red circle | a blue square", num_validation_images=1,
                validation_inference_steps=2, validation_loss_every=0)


def _images(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.png"))}


def _lora(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path)


def test_step0_images_a_stopped_run_owed_are_made_after_its_resume(tiny_config, tmp_path, one_thread):
    """37.13: a stop at step 1 comes before any step-0 image (one is due every 3 steps); the resumed run makes
    them between its steps, from the base model, equal byte for byte to those of a run that was never stopped,
    and its LoRA is bitwise the one of an uninterrupted run."""
    from stabletune_core.train.loop import train

    stopped = tmp_path / "stopped"
    stopped.mkdir()
    RunPaths(stopped).control.write_text(json.dumps({"command": "stop"}))  # the UI's stop, read after step 1
    train(tiny_config(max_train_steps=6, lora_dropout=0.1, output_dir=str(stopped), **SAMPLING))
    step0 = RunPaths(stopped).sample_dir(0)
    assert _images(step0) == {}, "the stop came before the first step-0 image"
    assert RunReader(stopped).status()["state"] == "stopped"

    train(tiny_config(max_train_steps=3, lora_dropout=0.1, output_dir=str(stopped), resume_from_checkpoint="auto",
                      **SAMPLING))
    said = [e["message"] for e in RunReader(stopped).events() if e["kind"] == "samples"]
    assert said[0] == "Made 0 of 2 validation images at step 0; a stop ended the sampling."
    assert said[1].startswith("The step-0 validation images are missing (0 of 2 made before the resume); making")
    assert said[2] == "Made 2 validation images at step 0."

    straight = tmp_path / "straight"
    train(tiny_config(max_train_steps=3, lora_dropout=0.1, output_dir=str(straight), **SAMPLING))
    made = _images(step0)
    assert sorted(made) == ["p00_s3.png", "p01_s3.png"]
    assert made == _images(RunPaths(straight).sample_dir(0))
    a, b = _lora(RunPaths(stopped).lora("lora")), _lora(RunPaths(straight).lora("lora"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "making them changed the training"


def test_an_ema_file_of_earlier_steps_is_set_aside_when_the_resumed_run_has_none(tiny_config, tmp_path,
                                                                                 one_thread):
    """37.12: resumed with ema_decay 0 after an EMA run, the step-2 lora-ema.safetensors would sit beside the
    step-3 LoRA looking current; it is renamed with the step it is from (never deleted), with a console line."""
    from stabletune_core.train.loop import train

    run = tmp_path / "run"
    train(tiny_config(max_train_steps=2, save_steps=2, ema_decay=0.9, output_dir=str(run)))
    paths = RunPaths(run)
    earlier = paths.lora("lora-ema").read_bytes()
    train(tiny_config(max_train_steps=3, save_steps=2, ema_decay=0.0, output_dir=str(run),
                      resume_from_checkpoint="auto"))
    assert not paths.lora("lora-ema").exists()
    aside = paths.lora("lora-ema_step000002")
    assert aside.read_bytes() == earlier  # the same file, moved
    assert read_lora_metadata(paths.lora("lora"))["ss_steps"] == "3"
    said = [e for e in RunReader(run).events() if e["kind"] == "exported" and "lora-ema_step000002" in e["message"]]
    assert len(said) == 1 and "not of this LoRA" in said[0]["message"]


def test_a_run_shorter_than_one_sampling_interval_is_sampled_at_its_end(tiny_config, tmp_path, one_thread):
    """37.8: validation_steps 1000 and a 2-step run: the LoRA's images are made at its last step, so the summary
    and the Samples tab compare step 0 with the trained LoRA, not with itself."""
    from stabletune_core.train.loop import train

    run = tmp_path / "run"
    train(tiny_config(max_train_steps=2, learning_rate=1e-2, output_dir=str(run), **SAMPLING))
    steps = [step for step, _ in RunReader(run).sample_steps()]
    assert steps == [0, 2]
    assert _images(RunPaths(run).sample_dir(2)) != _images(RunPaths(run).sample_dir(0))  # the LoRA changed them
