"""#13.6 EMA of the adapter weights: the average is right, it survives resume exactly, it is exported beside the
LoRA as NAME-ema.safetensors, and validation images show it (or the trained weights, by choice)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stabletune_core.train.checkpoint import load_checkpoint
from stabletune_core.train.ema import AdapterEMA


def test_the_average_follows_the_warmed_up_decay_and_swaps_back_bit_for_bit():
    weight = torch.nn.Parameter(torch.zeros(3))
    ema = AdapterEMA([weight], decay=0.9)
    expected = torch.zeros(3)
    for n, value in enumerate((1.0, 2.0, 3.0, 4.0)):
        with torch.no_grad():
            weight.fill_(value)
        decay = min(0.9, (1 + n) / (10 + n))
        expected = decay * expected + (1 - decay) * torch.full((3,), value)
        ema.update()
    assert torch.allclose(ema.shadow[0], expected)
    trained = weight.detach().clone()
    with ema.swapped_in():
        assert torch.allclose(weight, expected)
    assert torch.equal(weight, trained)

    restored = AdapterEMA([weight], decay=0.9, on_cpu=True)
    restored.load_state_dict(ema.state_dict())
    assert torch.equal(restored.shadow[0], ema.shadow[0]) and restored.updates == 4
    assert restored.shadow[0].device.type == "cpu"
    with pytest.raises(ValueError, match="same LoRA settings"):
        AdapterEMA([weight, weight], decay=0.9).load_state_dict(ema.state_dict())


COMMON = dict(ema_decay=0.8, max_train_steps=8, save_steps=4, lora_dropout=0.1, train_text_encoder=True,
              diagnostics_every=0, activation_stats_every=0, validation_loss_every=0)


def test_ema_is_exported_beside_the_lora_and_resumes_exactly(tiny_config, one_thread, tmp_path):
    from stabletune_core.lora.export import export_kohya_lora
    from stabletune_core.train.loop import setup, train

    straight = tiny_config(output_dir=str(tmp_path / "straight"), **COMMON)
    session = setup(straight)
    lora = train(straight, session=session)
    ema_file = lora.with_name("lora-ema.safetensors")
    plain, averaged = load_file(lora), load_file(ema_file)
    assert plain.keys() == averaged.keys()
    ups = [k for k in plain if "lora_up" in k]
    assert ups and all(averaged[k].abs().sum() > 0 for k in ups)  # it moved away from the zero init ...
    assert any(not torch.allclose(plain[k], averaged[k]) for k in ups)  # ... and is not the last weights
    with session.ema.swapped_in():  # the file holds exactly the session's average
        unet = session.ranks.unwrap(session.trained["unet"])
        encoders = [session.ranks.unwrap(session.trained[k]) for k in session.trained if k != "unet"]
        again = export_kohya_lora(tmp_path / "again.safetensors", unet, encoders, session.bundle.family,
                                  rank=straight.lora_rank, alpha=straight.effective_lora_alpha, metadata={},
                                  dtype=torch.float32)
    assert all(torch.equal(averaged[k], v) for k, v in load_file(again).items())

    resumed = tiny_config(output_dir=str(tmp_path / "resumed"), **COMMON,
                          resume_from_checkpoint=str(tmp_path / "straight" / "checkpoints" / "step_000004"))
    train(resumed)
    a, b = (load_checkpoint(tmp_path / run / "checkpoints" / "step_000008") for run in ("straight", "resumed"))
    assert a.state["ema"]["updates"] == b.state["ema"]["updates"] == 8
    assert all(torch.equal(x, y) for x, y in zip(a.state["ema"]["shadow"], b.state["ema"]["shadow"]))
    for name in ("lora.safetensors", "lora-ema.safetensors"):
        x, y = (load_file(tmp_path / run / "output" / name) for run in ("straight", "resumed"))
        assert all(torch.equal(x[k], y[k]) for k in x), name


def test_validation_images_show_the_ema_or_the_trained_weights_by_choice(tiny_config, one_thread, tmp_path):
    from stabletune_core.train.loop import train

    def run(name: str, with_ema: bool) -> tuple[Path, Path]:
        config = tiny_config(output_dir=str(tmp_path / name), **{**COMMON, "save_steps": 1000},
                             validation_with_ema=with_ema, validation_prompt="a red circle", validation_steps=8,
                             num_validation_images=1, validation_inference_steps=2)
        lora = train(config)
        return lora, next((tmp_path / name / "samples" / "step_000008").glob("*.png"))

    (lora_a, image_a), (lora_b, image_b) = run("ema", True), run("trained", False)
    a, b = load_file(lora_a), load_file(lora_b)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the choice never changes training
    assert image_a.read_bytes() != image_b.read_bytes()
