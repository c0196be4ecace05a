"""Diagnostics on real adapters: spectra vs a full SVD, rank-collapse warnings, activation stats, the LPIPS term,
validation sampler settings."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model

from stabletune_core.lora.svd import block_of, detect_collapse, lora_factors, spectra


def _events(run: Path) -> list[dict]:
    path = run / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []



pytestmark = pytest.mark.usefixtures("one_thread")

# ---- spectra --------------------------------------------------------------------------------------------
def test_spectra_match_a_full_svd_of_delta_w():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"lin": torch.nn.Linear(24, 40), "narrow": torch.nn.Linear(40, 3),
                                 "conv": torch.nn.Conv2d(6, 10, 3)})
    inject_adapter_in_model(LoraConfig(r=5, lora_alpha=10, target_modules=["lin", "narrow", "conv"]), model)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = torch.randn_like(p) * (3.0 if "lora_B" in name else 0.5)
    found = {sp.module: sp for sp in spectra(list(lora_factors(model)))}
    assert set(found) == {"lin", "narrow", "conv"}
    for name in found:
        layer = model[name]
        a, b = layer.lora_A["default"].weight.detach().double(), layer.lora_B["default"].weight.detach().double()
        delta = layer.scaling["default"] * b.reshape(b.shape[0], -1) @ a.reshape(a.shape[0], -1)
        full = torch.linalg.svdvals(delta)[: min(5, *delta.shape)]
        sp = found[name]
        torch.testing.assert_close(torch.tensor(sp.singular_values, dtype=torch.float64), full, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.tensor(sp.normalized, dtype=torch.float64), full / full[0], rtol=1e-4,
                                   atol=1e-5)
        assert sp.frobenius == pytest.approx(float(torch.linalg.matrix_norm(delta)), rel=1e-4)
        assert sp.stable_rank == pytest.approx(float(torch.linalg.matrix_norm(delta) ** 2 / full[0] ** 2), rel=1e-4)
        p = full / full.sum()
        assert sp.effective_rank == pytest.approx(math.exp(float(-(p * p.log()).sum())), rel=1e-4)
        assert sp.up_down_ratio == pytest.approx(float(b.norm() / a.norm()), rel=1e-4)
    assert len(found["narrow"].singular_values) == 3  # d = 3 < r = 5: only 3 can be non-zero


def _set_adapters(session, collapsed: set[str] | None = None, seed: int = 0) -> None:
    """Random healthy adapters; modules whose name contains one of `collapsed` get a rank-1 update (plus a
    whisper of noise, so the second singular value is tiny but not zero)."""
    g = torch.Generator().manual_seed(seed)
    unet = session.ranks.unwrap(session.trained["unet"])
    for name, layer in unet.named_modules():
        if not isinstance(getattr(layer, "lora_A", None), torch.nn.ModuleDict):
            continue
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        new_a = torch.randn(a.shape, generator=g)
        new_b = torch.randn(b.shape, generator=g)
        if collapsed and any(part in name for part in collapsed):
            u = torch.randn(b.shape[0], 1, generator=g)
            new_b = u @ torch.randn(1, b.shape[1], generator=g) + 1e-3 * new_b
        with torch.no_grad():
            a.copy_(new_a)
            b.copy_(new_b)


def test_rank_collapse_warns_naming_the_first_block_and_a_healthy_adapter_does_not(tiny_config):
    from extension import diagnostics as ui_diagnostics
    from stabletune_core.runs.reader import RunReader
    from stabletune_core.train.observers.diagnostics import SpectralMonitor
    from stabletune_core.train.loop import setup
    from stabletune_core.train.session import SessionView

    config = tiny_config(diagnostics_every=1, activation_stats_every=0, validation_loss_every=0)
    s = setup(config)
    run = Path(config.output_dir)
    monitor = SpectralMonitor(config)
    view = SessionView(s)

    _set_adapters(s)  # healthy
    s.state.step = 1
    assert monitor.observe(view).events == ()

    # The mid block and every up block collapse (7 of the 10 attention blocks); the down blocks stay healthy.
    _set_adapters(s, collapsed={"mid_block", "up_blocks"})
    s.state.step = 2
    found, events = monitor.check(view)
    for event in events:  # as the loop records them
        s.run.event(event.kind, event.message, console=event.console, **event.fields)
    collapse = detect_collapse(found, config.collapse_threshold)
    assert collapse is not None and collapse.first_block == "unet.mid_block"
    warnings = [e for e in _events(run) if e["kind"] == "collapse"]
    assert len(warnings) == 1 and warnings[0]["block"] == "unet.mid_block" and warnings[0]["step"] == 2
    assert "unet.mid_block" in warnings[0]["message"]
    s.state.step = 3
    assert monitor.check(view)[1] == ()  # still collapsed: no second warning

    lines = [json.loads(line) for line in (run / "diagnostics" / "spectra.jsonl").read_text().splitlines()]
    modules = {r["module"] for r in lines}
    assert len(lines) == 3 * len(modules) and all(len(r["singular_values"]) == config.lora_rank for r in lines)
    assert {"normalized", "effective_rank", "stable_rank", "frobenius", "up_down_ratio", "block"} <= set(lines[0])
    healthy = [r for r in lines if r["step"] == 1]
    assert all(r["normalized"][1] > config.collapse_threshold for r in healthy)
    # The UI's Diagnostics tab reads the same file and the warning.
    reader = RunReader(run)
    records = ui_diagnostics.spectra(reader)
    assert len(records) == len(lines) and ui_diagnostics.modules(records) == sorted(modules)
    assert any("mid_block" in str(row[2]) for row in ui_diagnostics.warnings(reader))
    assert block_of("te0.text_model.encoder.layers.1.self_attn.q_proj") == "te0.text_model.encoder.layers.1"


def test_activation_stats_on_the_fixed_probe(tiny_config):
    from stabletune_core.train.observers.diagnostics import ActivationMonitor
    from stabletune_core.train.loop import setup
    from stabletune_core.train.session import SessionView

    config = tiny_config(activation_stats_every=1, diagnostics_every=0, validation_loss_every=0)
    s = setup(config)
    view = SessionView(s)
    monitor = ActivationMonitor(config, s.evaluator)
    at_init = monitor.measure(view)  # B starts at zero: the LoRA path outputs exact zeros
    assert at_init and all(r["zero_fraction"] == 1.0 and r["relative_rms"] == 0.0 for r in at_init)
    _set_adapters(s)
    s.state.step = 1
    monitor.observe(view)
    lines = [json.loads(line) for line in (Path(config.output_dir) / "diagnostics" / "activations.jsonl")
             .read_text().splitlines()]
    assert {r["module"] for r in lines} == {r["module"] for r in at_init}
    assert all(r["zero_fraction"] == 0.0 and r["var"] > 0 and r["relative_rms"] > 0 for r in lines)
    again = monitor.measure(view)  # a fixed probe: the same numbers each time
    assert [r["var"] for r in again] == [r["var"] for r in lines]


# ---- the LPIPS term -------------------------------------------------------------------------------------
def test_perceptual_term_changes_gradients_when_on_and_is_absent_at_lambda_zero(tiny_config):
    from stabletune_core.train.setup import setup
    from stabletune_core.train.loop import forward_backward
    from stabletune_core.train.step import next_batches

    config = tiny_config(perceptual_lambda=1.0, perceptual_random_backbone=True, perceptual_timestep_max=1000,
                         perceptual_batch=2, validation_loss_every=0, diagnostics_every=0, activation_stats_every=0)
    s = setup(config)
    events = _events(Path(config.output_dir))
    said = [e for e in events if e["kind"] == "perceptual"]
    assert len(said) == 1 and "NOT the LPIPS perceptual metric" in said[0]["message"] and not said[0]["real_lpips"]
    batches = next_batches(s.feed, s.state, 1)
    decodes = []
    original_decode = s.bundle.vae.decode
    s.bundle.vae.decode = lambda *a, **k: decodes.append(1) or original_decode(*a, **k)

    def grads(s) -> tuple[float, list[torch.Tensor]]:
        s.optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(s, batches).mean  # the batch's own generator: the same noise each time
        return loss, [p.grad.clone() for p in s.params]

    loss_on, with_term = grads(s)
    assert len(decodes) == 1 and s.perceptual.take_mean() > 0
    loss_off, without = grads(dataclasses.replace(s, perceptual=None))  # what setup builds at perceptual_lambda = 0
    assert len(decodes) == 1, "the VAE decoded with the term off"
    assert loss_on == pytest.approx(loss_off)  # the reported loss stays the diffusion loss
    assert any(not torch.allclose(a, b) for a, b in zip(with_term, without))

    off = tiny_config(output_dir=str(Path(config.output_dir).parent / "off"), validation_loss_every=0)
    s_off = setup(off)
    assert s_off.perceptual is None and not [g for g in s_off.guards if g.name == "perceptual"]


def test_perceptual_refuses_without_backbone_weights(tiny_config, tmp_path, monkeypatch):
    from stabletune_core.config import ConfigError
    from stabletune_core.train.loop import setup

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty-torch-home"))
    with pytest.raises(ConfigError, match="ImageNet weights of the LPIPS alex backbone"):
        setup(tiny_config(perceptual_lambda=0.1))


def test_predicted_x0_inverts_the_noising_for_epsilon_and_v():
    from diffusers import DDPMScheduler

    from stabletune_core.models.ddpm import DDPMObjective

    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)
    t = torch.tensor([5, 400, 999])
    for kind in ("epsilon", "v_prediction"):
        objective = DDPMObjective(DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear",
                                                beta_start=0.00085, beta_end=0.012, prediction_type=kind))
        noisy = objective.noisy_input(x0, noise, t)
        exact = objective.target(x0, noise, t)
        torch.testing.assert_close(objective.predicted_clean(noisy, exact, t), x0, atol=2e-3, rtol=1e-3)


# ---- validation images: sampler settings ----------------------------------------------------------------
def test_validation_sampler_and_ddim_eta_take_effect(tiny_config, tmp_path):
    import numpy as np
    from PIL import Image

    from stabletune_core.models.loading import load_model
    from stabletune_core.train.validation_images import make_validation_images

    def render(folder: str, **overrides) -> np.ndarray:
        config = tiny_config(validation_prompt="a red circle", num_validation_images=1, validation_inference_steps=3,
                             **overrides)
        paths = make_validation_images(bundle, config, tmp_path / folder, torch.device("cpu"))
        return np.asarray(Image.open(paths[0]), dtype=np.int16)

    bundle = load_model(tiny_config())
    eta0 = render("a", validation_sampler="ddim", validation_ddim_eta=0.0)
    assert (render("b", validation_sampler="ddim", validation_ddim_eta=0.0) == eta0).all()
    eta1 = render("c", validation_sampler="ddim", validation_ddim_eta=1.0)
    assert (render("d", validation_sampler="ddim", validation_ddim_eta=1.0) == eta1).all()  # seeded, so repeatable
    assert np.abs(eta1 - eta0).max() > 0, "DDIM eta did not reach the scheduler"
    assert np.abs(render("e", validation_sampler="euler_a") - eta0).max() > 0
