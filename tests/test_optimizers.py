"""Lion, Adafactor and schedule-free AdamW: each trains (loss falls on a fixed batch) and resumes exactly."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from stabletune_core.config import ConfigError, build_config
from stabletune_core.data import collate
from stabletune_core.train.checkpoint import load_checkpoint

STEPS, SAVE = 8, 4
RATES = {"lion": 3e-3, "adafactor": 1e-2, "adamw_schedulefree": 1e-2}


@pytest.mark.parametrize("optimizer", list(RATES))
def test_trains_and_resumes_exactly(optimizer, tiny_config, one_thread, tmp_path):
    from stabletune_core.train.loop import setup, train

    import importlib

    importlib.import_module({"lion": "lion_pytorch", "adafactor": "transformers",  # dev install: never skipped
                             "adamw_schedulefree": "schedulefree"}[optimizer])
    common = dict(optimizer=optimizer, learning_rate=RATES[optimizer], max_train_steps=STEPS, save_steps=SAVE,
                  lora_dropout=0.1, random_flip=True, diagnostics_every=0, activation_stats_every=0,
                  validation_loss_every=0)
    straight = tiny_config(output_dir=str(tmp_path / "straight"), **common)
    session = setup(straight)
    assert type(session.optimizer.optimizer).__name__ == {"lion": "Lion", "adafactor": "Adafactor",
                                                           "adamw_schedulefree": "AdamWScheduleFree"}[optimizer]
    batch = collate([session.data.example(i, 0) for i in range(4)])
    before = session.evaluator.batch_loss(batch)
    train(straight, session=session)
    after = session.evaluator.batch_loss(batch)
    assert after < 0.95 * before, (before, after)

    resumed = tiny_config(output_dir=str(tmp_path / "resumed"), **common,
                          resume_from_checkpoint=str(tmp_path / "straight" / "checkpoints" / f"step_{SAVE:06d}"))
    train(resumed)
    final = f"checkpoints/step_{STEPS:06d}"
    a = load_checkpoint(tmp_path / "straight" / final)
    b = load_checkpoint(tmp_path / "resumed" / final)
    assert a.adapter.keys() == b.adapter.keys() and all(torch.equal(a.adapter[k], b.adapter[k]) for k in a.adapter)
    exported = [load_file(tmp_path / run / "output" / "lora.safetensors") for run in ("straight", "resumed")]
    assert all(torch.equal(exported[0][k], exported[1][k]) for k in exported[0])


def test_schedule_free_exports_its_evaluation_weights_and_keeps_training_weights_exact(tiny_config, one_thread):
    """Export swaps in the averaged weights x and puts the training point y back bit for bit."""
    import schedulefree  # noqa: F401  (dev install: never skipped)
    from stabletune_core.train.loop import setup, train
    from stabletune_core.train.optim import evaluation_weights

    config = tiny_config(optimizer="adamw_schedulefree", learning_rate=3e-3, max_train_steps=3,
                         diagnostics_every=0, activation_stats_every=0, validation_loss_every=0)
    session = setup(config)
    train(config, session=session)
    training = [p.detach().clone() for p in session.params]
    with evaluation_weights(session.optimizer):
        evaluation = [p.detach().clone() for p in session.params]
    assert all(torch.equal(p, q) for p, q in zip(session.params, training))  # restored exactly
    assert any(not torch.equal(p, q) for p, q in zip(evaluation, training))  # x really differs from y
    exported = load_file(session.run.paths.output / "lora.safetensors")
    ups = sorted(float(v.abs().sum()) for k, v in exported.items() if k.endswith("lora_up.weight"))
    live_ups = sorted(float(p.abs().sum()) for p in evaluation if p.ndim == 2 and p.shape[1] == config.lora_rank
                      and p.shape[0] != config.lora_rank)
    assert ups == pytest.approx(live_ups, rel=1e-5)  # the file holds x, not y


def test_missing_package_and_schedule_conflict_are_one_sentence(tiny_config, monkeypatch):
    import importlib.util

    from stabletune_core.train.optim import optimizer_problems

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lion_pytorch" else real(name, *a))
    assert optimizer_problems(tiny_config(optimizer="lion")) == [
        "optimizer=lion needs the lion-pytorch package: pip install lion-pytorch==0.2.5 (or choose optimizer=adamw)."]
    with pytest.raises(ConfigError) as caught:
        build_config({"optimizer": "adamw_schedulefree", "lr_scheduler": "cosine"})
    assert caught.value.problems == ["optimizer=adamw_schedulefree replaces the learning-rate schedule; set "
                                     "lr_scheduler=constant instead of cosine (lr_warmup_steps still warms up)."]


def test_default_adamw_uses_the_fused_kernel_with_the_same_update():
    """The default optimizer updates a LoRA's many small tensors in one fused kernel; the update is AdamW's."""
    from stabletune_core.train.optim import make_optimizer

    config = build_config({"pretrained_model_name_or_path": "x", "train_data_dir": ".", "output_dir": "o",
                           "adam_weight_decay": 1e-2})

    def trained(make):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4, 32)), torch.nn.Parameter(torch.randn(32, 4))]
        optimizer = make(params)
        for _ in range(10):
            for p in params:
                p.grad = torch.randn_like(p)
            optimizer.step()
        return optimizer, params

    fused, ours = trained(lambda params: make_optimizer([{"params": params}], config))
    assert fused.defaults["fused"] is True
    _, plain = trained(lambda params: torch.optim.AdamW(params, lr=config.learning_rate, eps=config.adam_epsilon,
                                                        betas=(config.adam_beta1, config.adam_beta2),
                                                        weight_decay=1e-2))
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(ours, plain))
