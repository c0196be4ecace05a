"""Every training knob does what its doc says: a few real steps on the tiny SD1 model for each, in this process,
asserting the knob's effect (not only that the run survives it).

Comparisons "on vs off" use one session and one sampler batch: its noise and timesteps are seeded by the
batch's place in the data order, so the same batch gets the same noise both times.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from stabletune_core.config import ConfigError, TrainConfig, build_config, resolve
from stabletune_core.runs.reader import RunReader

QUIET = dict(validation_loss_every=0, diagnostics_every=0, activation_stats_every=0)


@pytest.fixture
def knob_session(tiny_config, one_thread):
    """setup() of a tiny run with the given knobs (diagnostics off unless asked for)."""
    from stabletune_core.train.loop import setup

    return lambda **overrides: setup(tiny_config(**{**QUIET, **overrides}))


def step_gradients(s, batches) -> tuple[float, list[torch.Tensor]]:
    from stabletune_core.train.loop import forward_backward

    s.optimizer.zero_grad(set_to_none=True)
    loss = forward_backward(s, batches).mean
    return loss, [p.grad.clone() for p in s.params]


def metrics(run_dir: Path | str) -> list[dict]:
    return RunReader(Path(run_dir)).metrics()


def lora_b(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach() for n, p in module.named_parameters() if "lora_B" in n]


# ---- the loss -----------------------------------------------------------------------------------------------
def test_snr_gamma_reweights_each_image_by_min_snr(knob_session, monkeypatch):
    from stabletune_core.train import step
    from stabletune_core.train.forward import weigh

    s = knob_session(snr_gamma=1.0)
    batches = step.next_batches(s.feed, s.state, 1)
    seen = []

    def recording(objective, loss, timesteps):  # the step weighs each image's loss here (it keeps the raw one too)
        out = weigh(objective, loss, timesteps)
        seen.append((out.detach(), timesteps))
        return out

    monkeypatch.setattr(step, "weigh", recording)
    loss_on, grads_on = step_gradients(s, batches)
    s.objective.snr_gamma = None  # the family's objective weighs the loss
    loss_off, grads_off = step_gradients(s, batches)
    (weighted, timesteps), (plain, same_timesteps) = seen
    assert torch.equal(timesteps, same_timesteps)
    alphas = s.bundle.noise_scheduler.alphas_cumprod[timesteps].float()
    snr = alphas / (1 - alphas)
    weight = torch.clamp(snr, max=1.0) / snr  # epsilon prediction: min(SNR, gamma) / SNR
    assert (weight < 0.99).any()  # some image of the batch is really down-weighted
    assert torch.allclose(weighted, plain * weight, rtol=1e-5)
    assert loss_on < loss_off and any(not torch.allclose(a, b) for a, b in zip(grads_on, grads_off))


def test_noise_offset_shifts_each_channels_noise_by_a_constant(knob_session, monkeypatch):
    from stabletune_core.train import step
    from stabletune_core.train.noise import noised

    s = knob_session(noise_offset=0.1)
    batches = step.next_batches(s.feed, s.state, 1)
    drawn = []

    def recording(*args, **kw):
        out = noised(*args, **kw)
        drawn.append(out[1])
        return out

    monkeypatch.setattr(step, "noised", recording)
    step_gradients(s, batches)
    s.config.noise_offset = 0.0
    step_gradients(s, batches)
    shift = drawn[0] - drawn[1]  # same base noise, plus offset x one normal draw per (image, channel)
    per_channel = shift.mean(dim=(2, 3), keepdim=True)
    assert torch.allclose(shift, per_channel.expand_as(shift), atol=1e-6)
    assert 0.02 < float(per_channel.std()) < 0.5 and (per_channel.abs() > 1e-3).all()


# ---- learning rates and optimizers ---------------------------------------------------------------------------
@pytest.mark.parametrize("accumulation", [1, 2])
def test_scale_lr_multiplies_the_logged_rate_by_the_effective_batch(tiny_config, one_thread, accumulation):
    from stabletune_core.train.loop import train

    config = tiny_config(scale_lr=True, learning_rate=1e-4, train_batch_size=2,
                         gradient_accumulation_steps=accumulation, max_train_steps=2, **QUIET)
    train(config)
    assert [m["lr"] for m in metrics(config.output_dir)] == pytest.approx([1e-4 * 2 * accumulation] * 2)


def test_prodigy_adapts_its_step_size_uses_adam_epsilon_and_defaults_lr_to_one(tiny_config, one_thread):
    from stabletune_core.train.loop import setup, train

    config = build_config({**tiny_config().model_dump(exclude={"learning_rate"}), "optimizer": "prodigy",
                           "adam_epsilon": 1e-6, "max_train_steps": 8, **QUIET})
    assert config.learning_rate == 1.0 and not config.notes()  # Prodigy wants lr 1.0: unset means 1.0
    s = setup(config)
    group = s.optimizer.param_groups[0]
    d0 = group["d"]
    assert group["eps"] == 1e-6 and group["lr"] == 1.0
    train(config, session=s)
    assert group["d"] > 1.2 * d0  # the step size it estimates has grown from d0 (it starts slowly)
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics(config.output_dir))

    set_low = tiny_config(optimizer="prodigy", learning_rate=1e-4)  # set by the user: kept, with one note
    assert set_low.learning_rate == 1e-4
    (note,) = set_low.notes()
    assert "learning_rate 0.0001" in note and "1.0" in note


def test_plateau_keeps_the_warmup_then_lowers_the_rate_after_patience(tiny_config, one_thread):
    from stabletune_core.train.loop import train

    # A rate so small that validation loss cannot improve: every evaluation after the first is a plateau.
    config = tiny_config(lr_scheduler="plateau", lr_warmup_steps=2, learning_rate=1e-6, min_lr=0.0,
                         validation_loss_every=1, plateau_patience=2, plateau_factor=0.5, max_train_steps=5,
                         diagnostics_every=0, activation_stats_every=0)
    train(config)
    lrs = [m["lr"] for m in metrics(config.output_dir)]
    assert lrs[:3] == pytest.approx([0.5e-6, 1e-6, 1e-6])  # the warm-up is honoured
    assert lrs[3:] == pytest.approx([0.5e-6, 0.5e-6])  # evaluations 2 and 3 did not improve: lowered once
    plateaus = [e for e in RunReader(Path(config.output_dir)).events() if e["kind"] == "lr_plateau"]
    assert [e["step"] for e in plateaus] == [3, 5]  # and again after two more


def test_plateau_without_validation_loss_is_refused_in_one_sentence(tiny_config):
    with pytest.raises(ConfigError) as refused:
        tiny_config(lr_scheduler="plateau", validation_loss_every=0)
    (sentence,) = refused.value.problems
    assert "plateau" in sentence and "validation_loss_every" in sentence and sentence.count(". ") == 0


def test_text_encoder_lr_is_the_text_encoder_groups_rate(knob_session):
    """Adam's first step moves every weight with a non-zero gradient by its group's rate, so after one step the
    largest text-encoder LoRA weight is text_encoder_lr and the largest UNet one is learning_rate."""
    from stabletune_core.train.loop import training_step
    from stabletune_core.train.step import next_batches

    s = knob_session(train_text_encoder=True, text_encoder_lr=3e-4, learning_rate=1e-3, adam_weight_decay=0.0)
    te_params = {id(p) for p in s.bundle.text_encoders[0].parameters()}
    (te_group,) = [g for g in s.optimizer.param_groups if id(g["params"][0]) in te_params]
    assert te_group["lr"] == 3e-4
    training_step(s, next_batches(s.feed, s.state, 1))
    te_max = max(float(b.abs().max()) for b in lora_b(s.bundle.text_encoders[0]))
    unet_max = max(float(b.abs().max()) for b in lora_b(s.bundle.denoiser))
    assert te_max == pytest.approx(3e-4, rel=1e-3) and unet_max == pytest.approx(1e-3, rel=1e-3)


def test_cached_text_embeddings_allow_caption_dropout_and_cache_the_empty_caption(knob_session):
    from stabletune_core.train.loop import train

    s = knob_session(cache_text_embeddings=True, caption_dropout_rate=0.5, max_train_steps=2)
    empty = s.inputs.text_cache.get("")
    direct = s.inputs.encode_text([""], grad=False)["encoder_hidden_states"][0]
    assert torch.allclose(empty["encoder_hidden_states"], direct, atol=1e-5)
    train(s.config, session=s)
    assert len(metrics(s.config.output_dir)) == 2


# ---- memory and precision -------------------------------------------------------------------------------------
def test_gradient_checkpointing_is_on_in_the_unet_and_gives_the_same_gradients(knob_session):
    from stabletune_core.train.step import next_batches

    s = knob_session(gradient_checkpointing=True)
    unet = s.bundle.denoiser
    assert unet.is_gradient_checkpointing
    recomputed = []
    for module in unet.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            inner = module._gradient_checkpointing_func
            module._gradient_checkpointing_func = lambda *a, _inner=inner, **k: recomputed.append(1) or _inner(*a, **k)
    batches = next_batches(s.feed, s.state, 1)
    loss_ckpt, with_ckpt = step_gradients(s, batches)
    assert recomputed, "no block ran through gradient checkpointing"
    unet.disable_gradient_checkpointing()
    loss_plain, plain = step_gradients(s, batches)
    assert loss_ckpt == pytest.approx(loss_plain, rel=1e-6)
    for a, b in zip(with_ckpt, plain):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_bf16_runs_the_unet_in_bf16_and_keeps_the_lora_in_fp32(knob_session):
    """Needs no reset of accelerate's process-wide state any more: the Accelerator always runs without mixed
    precision (train/amp.py owns it), so runs of different precisions share one process."""
    from stabletune_core.train.loop import train

    s = knob_session(mixed_precision="bf16", max_train_steps=2)
    unet = s.bundle.denoiser
    base = [p for n, p in unet.named_parameters() if "lora_" not in n]
    assert {p.dtype for p in base} == {torch.bfloat16}
    assert {p.dtype for p in s.params} == {torch.float32}
    outputs = []
    unet.conv_out.register_forward_hook(lambda m, a, out: outputs.append(out.dtype))
    before = [b.clone() for b in lora_b(unet)]
    train(s.config, session=s)
    assert outputs and set(outputs) == {torch.bfloat16}
    assert {p.dtype for p in s.params} == {torch.float32}
    assert any(not torch.equal(a, b) for a, b in zip(before, lora_b(unet)))


# ---- data and output ------------------------------------------------------------------------------------------
def test_num_train_epochs_gives_epochs_times_steps_per_epoch(tiny_config, one_thread):
    from stabletune_core.train.loop import train

    # 8 images in batches of 4 with accumulation 1: 2 steps per epoch
    config = tiny_config(max_train_steps=None, num_train_epochs=2, train_batch_size=4, **QUIET)
    train(config)
    got = metrics(config.output_dir)
    assert [m["step"] for m in got] == [1, 2, 3, 4]
    assert got[-1]["images_seen"] == 16 and [m["epoch"] for m in got] == [0, 0, 1, 1]


def test_cache_latents_to_disk_writes_the_latents_training_reads(knob_session, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from stabletune_core.train.step import next_batches

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # wherever the cache lives, it is under tmp_path
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    s = knob_session(cache_latents=True, cache_latents_to_disk=True, max_train_steps=2)
    files = [f for f in tmp_path.rglob("*.safetensors") if "output" not in f.parts and "checkpoints" not in f.parts]
    on_disk = [load_file(f) for f in files]
    latents = [t for tensors in on_disk for t in tensors.values() if t.dim() == 3]
    assert len(latents) == 8  # one file per image of the shapes dataset
    batch = next_batches(s.feed, s.state, 1)[0]
    from_cache = s.inputs.latent_cache.get_batch(batch["index"])
    for row in from_cache:
        assert any(torch.equal(row, latent) for latent in latents)


def test_export_diffusers_format_writes_a_folder_diffusers_loads_and_replaces_it_on_a_later_export(
        knob_session, tiny_model):
    from diffusers import StableDiffusionPipeline

    from stabletune_core.train.loop import export, train

    s = knob_session(export_diffusers_format=True, max_train_steps=2)
    train(s.config, session=s)
    folder = Path(s.config.output_dir) / "output" / "lora_diffusers"
    pipe = StableDiffusionPipeline.from_pretrained(str(tiny_model), safety_checker=None)
    pipe.load_lora_weights(str(folder))
    trained = s.ranks.unwrap(s.trained["unet"])
    loaded = dict(pipe.unet.named_parameters())
    pairs = [(loaded[n.replace(".default.", ".default_0.")], p) for n, p in trained.named_parameters()
             if "lora_B" in n]
    assert pairs and all(torch.equal(a, b) for a, b in pairs)

    # A second export in the same run (a resume, early stopping's next best) replaces our own earlier one.
    with torch.no_grad():
        for p in lora_b(trained):
            p.mul_(2)
    export(s)
    again = StableDiffusionPipeline.from_pretrained(str(tiny_model), safety_checker=None)
    again.load_lora_weights(str(folder))
    loaded = dict(again.unet.named_parameters())
    assert all(torch.equal(loaded[n.replace(".default.", ".default_0.")], p)
               for n, p in trained.named_parameters() if "lora_B" in n)
    assert sorted(p.name for p in folder.iterdir()) == ["pytorch_lora_weights.safetensors"]
    assert json.loads((Path(s.config.output_dir) / "status.json").read_text())["state"] == "finished"


# ---- the LPIPS regulariser ------------------------------------------------------------------------------------
def test_perceptual_term_does_not_depend_on_the_micro_batch_and_decodes_in_fp32(knob_session):
    """After an OOM halving the same images get the LPIPS term with the same weight (it is chosen per sampler
    batch and is the mean over the chosen images), and the VAE decodes for it in its own fp32, outside any
    autocast (a bf16 autocast around the step stands in for fp16, which CPUs do not autocast)."""
    from stabletune_core.train.step import next_batches

    s = knob_session(perceptual_lambda=1.0, perceptual_random_backbone=True, perceptual_timestep_max=1000,
                     perceptual_batch=2, train_batch_size=4)
    batches = next_batches(s.feed, s.state, 1)
    decoded = []
    s.bundle.vae.decoder.conv_out.register_forward_hook(lambda m, a, out: decoded.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        step_gradients(s, batches)
    assert decoded == [torch.float32]
    s.perceptual.take_mean()

    loss_4, grads_4 = step_gradients(s, batches)
    lpips_4 = s.perceptual.take_mean()
    s.state.micro_batch_size = 2
    loss_2, grads_2 = step_gradients(s, batches)
    lpips_2 = s.perceptual.take_mean()
    s.state.micro_batch_size = 1
    _, grads_1 = step_gradients(s, batches)
    assert lpips_4 == pytest.approx(lpips_2, rel=1e-5) and loss_4 == pytest.approx(loss_2, rel=1e-6)
    flat = lambda grads: torch.cat([g.flatten() for g in grads])  # noqa: E731
    _, without = step_gradients(dataclasses.replace(s, perceptual=None), batches)
    term = (flat(grads_4) - flat(without)).norm()  # what the LPIPS term adds to the gradient
    assert term > 1e-2 * flat(without).norm()  # it is really there
    for other in (grads_2, grads_1):  # and the same whatever the micro-batch, up to float summation order
        assert (flat(other) - flat(grads_4)).norm() <= 1e-3 * term


def test_validation_epochs_becomes_steps_as_diffusers_means_it(tiny_config, one_thread):
    """diffusers' flag counts epochs: 8 images at batch 4 are 2 steps an epoch, so every 3 epochs = 6 steps."""
    from stabletune_core.train.loop import setup

    config = tiny_config(validation_epochs=3, validation_prompt="a red circle", validation_split=0, seed=-1)
    s = setup(config)
    assert s.config.validation_steps == 6 and config.validation_steps == 250  # resolved, the user's config untouched
    events = (s.run.paths.events).read_text()
    assert "validation_epochs 3 = validation images every 6 steps" in events
    # Issue 22.4: RUN/config.toml is exactly what the run uses (the seed it drew, the steps it counts)
    saved = TrainConfig.from_toml(s.run.paths.config)
    assert saved == s.config and saved.validation_steps == 6 and saved.seed == s.config.seed != -1
    assert resolve(saved, seed=1, steps_per_epoch=2) == saved  # a resolved config resolves to itself
