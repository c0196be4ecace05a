"""Issue 25.5 (engine half): the step-0 validation images are made between training steps, from the adapter
weights frozen at step 0, without touching the training: the images equal those of a run that trained less
before making them, and the LoRA equals that of a run that made no images at all."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def _run(small_config, tiny_model: Path, output: Path, **overrides) -> Path:
    from stabletune_core.train.loop import train

    values = dict(max_train_steps=6, learning_rate=1e-2, lora_dropout=0.1, validation_steps=1000,
                  validation_prompt="a red circle | a blue square", num_validation_images=1,
                  validation_inference_steps=2, validation_loss_every=0)
    values.update(overrides)
    return train(small_config(tiny_model, output, **values))


def _step0_images(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run / "samples" / "step_000000").glob("*.png"))}


def test_step0_images_come_from_the_frozen_step0_weights_and_leave_training_bitwise_equal(
        small_config, tiny_model, tmp_path, one_thread):
    deferred = _run(small_config, tiny_model, tmp_path / "six")  # one image after step 3, one after step 6
    events = [json.loads(line) for line in (tmp_path / "six" / "events.jsonl").read_text().splitlines()]
    made = next(e for e in events if e["kind"] == "samples" and e["step"] == 0)
    assert made["message"] == "Made 2 validation images at step 0."
    metrics = [json.loads(line) for line in (tmp_path / "six" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["step"] == 1 and metrics[0]["time"] < made["time"]  # step 1 did not wait for them

    _run(small_config, tiny_model, tmp_path / "one", max_train_steps=1)  # both images made after step 1
    assert len(_step0_images(tmp_path / "six")) == 2
    assert _step0_images(tmp_path / "six") == _step0_images(tmp_path / "one")

    plain = _run(small_config, tiny_model, tmp_path / "plain", validation_prompt="")
    a, b = load_file(deferred), load_file(plain)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the step-0 images changed training"
    assert any(bool(a[k].abs().sum()) for k in a if "lora_up" in k)  # it trained: the images had to be swapped
