"""Overfitting for real: a LoRA that memorises 4 images of the concept, on the pretrained toy base.

Held-out images of the same concept measure validation loss; early stopping must see it turn up and stop
soon after its minimum; the LoRA it keeps as the best and the last one both carry the concept's colour to a prompt
they never trained on (a purple *triangle*: the training images are circles and squares).
"""
from __future__ import annotations

import json
from pathlib import Path


from stabletune_core.toy.world import CONCEPT_COLOR, concept_scenes, write_dataset

EVERY = 20  # steps between validation-loss evaluations
WINDOW = 5


def _val_losses(run: Path) -> list[tuple[int, float]]:
    lines = (run / "diagnostics" / "val_loss.jsonl").read_text().splitlines()
    return [(row["step"], row["val_loss"]) for row in map(json.loads, lines)]


def test_memorising_four_images_turns_held_out_loss_up_and_early_stopping_keeps_the_better_lora(
        toy_base, tmp_path, one_thread):
    from stabletune_core.config import build_config
    from stabletune_core.toy import load_toy_pipeline
    from stabletune_core.toy.evaluate import scores, render
    from stabletune_core.train.loop import train

    data = write_dataset(tmp_path / "data", [s for s in concept_scenes(12, seed=5) if s.shape != "triangle"])
    run = tmp_path / "run"
    config = build_config(dict(
        pretrained_model_name_or_path=str(toy_base), train_data_dir=str(data), output_dir=str(run),
        resolution=64, bucket_step=8, min_bucket_reso=32, max_bucket_reso=128, train_batch_size=4,
        learning_rate=3e-3, train_text_encoder=True, text_encoder_lr=3e-3, lora_rank=16, lora_alpha=16, max_train_steps=400, seed=1, save_precision="fp32",
        validation_split=0.5, validation_count=4, validation_loss_every=EVERY, validation_timesteps=8,
        early_stopping=True, early_stopping_window=WINDOW, early_stopping_factor=1.05, early_stopping_patience=2,
        early_stopping_min_steps=0, save_steps=100000, diagnostics_every=0, activation_stats_every=0))
    train(config)

    history = _val_losses(run)
    best_step, best = min(history, key=lambda sv: sv[1])
    stop_step = history[-1][0]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    held = next(e for e in events if e["kind"] == "validation_split")
    assert len(held["held_out"]) == 4  # 4 images train, 4 are only measured
    # Memorisation shows: the held-out loss climbs clearly above its minimum...
    assert max(v for s, v in history if s > best_step) > 1.08 * best, history
    # ...and early stopping fires within two evaluation windows of that minimum.
    assert any(e["kind"] == "early_stop" for e in events), [e["kind"] for e in events]
    assert stop_step < config.max_train_steps and stop_step - best_step <= 2 * WINDOW * EVERY, (best_step, stop_step)

    seeds = list(range(2000, 2008))
    prompt = f"a {CONCEPT_COLOR} triangle"  # never trained: the LoRA must generalise the colour, not the images
    results = {}
    for name in ("lora_best", "lora"):
        pipe = load_toy_pipeline(toy_base)
        pipe.load_lora_weights(str(run / "output"), weight_name=f"{name}.safetensors")
        results[name] = scores(render(pipe, [prompt], seeds))[prompt]
    base = scores(render(load_toy_pipeline(toy_base), [prompt], seeds))[prompt]
    # In degrees, both LoRAs carry the colour to the untrained shape: the toy base draws "purple" as red (~77 deg
    # off), each LoRA within a third of that (measured on the v3 base: the early-stopped one 20 deg, the last 9).
    # The text-encoder LoRA is what lets "purple" leave red's side (issue 21.4); a UNet-only LoRA at its best
    # held-out step had not moved the untrained prompt at all (79 deg). Which LoRA draws the untrained shape more
    # often is not asserted: it was an artefact of the nearest-colour judge (issue 21.1).
    assert all(r["hue_error"] <= base["hue_error"] / 3 for r in results.values()), (results, base)
