"""Noise and loss options from kohya's sd-scripts: pyramid noise, input perturbation, debiased estimation."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import DDPMScheduler

from stabletune_core.models.ddpm import DDPMObjective
from stabletune_core.train.loss import per_sample_loss
from stabletune_core.train.noise import NoiseOptions, noised, pyramid_noise


@pytest.fixture(scope="module")
def scheduler():
    return DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")


def add_noise(scheduler, latents, generator, *, multires_noise_iterations=0, multires_noise_discount=0.3,
              ip_noise_gamma=0.0):
    options = NoiseOptions(pyramid_iterations=multires_noise_iterations, pyramid_discount=multires_noise_discount,
                           input_perturbation=ip_noise_gamma)
    return noised(DDPMObjective(scheduler), latents, generator, options)


def _low_frequency_share(noise: torch.Tensor, radius: int = 4) -> float:
    """Fraction of the spectral energy at spatial frequencies within `radius` of zero (both axes)."""
    power = torch.fft.fft2(noise.double()).abs() ** 2
    h, w = noise.shape[-2:]
    fy = torch.fft.fftfreq(h) * h
    fx = torch.fft.fftfreq(w) * w
    low = (fy.abs()[:, None] <= radius) & (fx.abs()[None, :] <= radius)
    return float(power[..., low].sum() / power.sum())


def test_pyramid_noise_has_more_low_frequency_energy(scheduler):
    latents = torch.randn(8, 4, 64, 64, generator=torch.Generator().manual_seed(0))
    draw = lambda **kw: add_noise(scheduler, latents, torch.Generator().manual_seed(1), **kw)  # noqa: E731
    _, white, _ = draw()
    noisy, gentle, t = draw(multires_noise_iterations=6, multires_noise_discount=0.3)
    _, strong, _ = draw(multires_noise_iterations=10, multires_noise_discount=0.8)
    share = {name: _low_frequency_share(n) for name, n in (("white", white), ("gentle", gentle), ("strong", strong))}
    # White noise spreads its energy evenly: 9 x 9 of the 64 x 64 frequency bins hold ~2 % of it.
    assert share["white"] == pytest.approx(81 / 4096, rel=0.15)
    # Measured: white 2.0 %, 6 levels at 0.3 about 2.6 %, 10 levels at 0.8 about 19 %.
    assert share["gentle"] > 1.2 * share["white"] and share["strong"] > 5 * share["white"], share
    assert float(gentle.std()) == pytest.approx(1.0, abs=1e-4)  # normalised like kohya's, so scales are unchanged
    torch.testing.assert_close(noisy, scheduler.add_noise(latents, gentle, t))  # the target is what was added
    _, again, _ = draw(multires_noise_iterations=6, multires_noise_discount=0.3)
    assert torch.equal(again, gentle)  # only the loop's generator is used: resumes draw the same noise


def test_input_perturbation_noises_the_input_not_the_target(scheduler):
    latents = torch.randn(16, 4, 32, 32, generator=torch.Generator().manual_seed(0))

    def effective_noise(gamma):
        noisy, target, t = add_noise(scheduler, latents, torch.Generator().manual_seed(2), ip_noise_gamma=gamma)
        ab = scheduler.alphas_cumprod[t].view(-1, 1, 1, 1)
        return (noisy - ab.sqrt() * latents) / (1 - ab).sqrt(), target

    used, target = effective_noise(0.1)
    assert float((used - target).std()) == pytest.approx(0.1, rel=0.03)  # the input saw target + 0.1 * N(0, 1)
    used, target = effective_noise(0.0)
    torch.testing.assert_close(used, target, atol=1e-4, rtol=1e-4)  # off: the input saw exactly the target


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_debiased_estimation_weights_by_inverse_sqrt_snr(scheduler, prediction_type):
    gen = torch.Generator().manual_seed(3)
    pred, target = torch.randn(4, 4, 8, 8, generator=gen), torch.randn(4, 4, 8, 8, generator=gen)
    t = torch.tensor([0, 100, 500, 999])
    scheduler = DDPMScheduler.from_config(scheduler.config, prediction_type=prediction_type)
    plain = per_sample_loss(pred, target)
    debiased = plain * DDPMObjective(scheduler, debiased=True).loss_weight(t)
    ratio = DDPMObjective(scheduler).snr(t)
    assert float(ratio[0]) > 1000  # the first timestep's SNR is capped, as kohya caps it
    capped = ratio.clamp(max=1000)
    want = 1 / (capped + 1) if prediction_type == "v_prediction" else 1 / capped.sqrt()
    torch.testing.assert_close(debiased / plain, want)
    weight = debiased / plain
    assert float(weight[3] / weight[0]) > 30  # the noisiest timestep now counts far more than the cleanest


def first_step_of_a_run(config, monkeypatch) -> dict:
    """Train one step with the real loop and record, without changing anything, what its first sampler batch met:
    the state of the batch's generator before the noise was drawn, the options the noise was drawn with, the
    denoiser's input and target, and the loss weights applied at the drawn timesteps."""
    from stabletune_core.train import step as step_module
    from stabletune_core.train.loop import train

    seen: dict = {}
    real_noised, real_weigh = step_module.noised, step_module.weigh

    def noised_spy(objective, latents, generator, options):
        seen.setdefault("generator_state", generator.get_state())
        seen.setdefault("options", options)
        out = real_noised(objective, latents, generator, options)
        seen.setdefault("latents", latents.detach().clone())
        seen.setdefault("noisy", out[0].detach().clone())
        return out

    def weigh_spy(objective, loss, timesteps):
        out = real_weigh(objective, loss, timesteps)
        seen.setdefault("weight", (out / loss).detach().clone())
        seen.setdefault("timesteps", timesteps.detach().clone())
        seen.setdefault("objective", objective)
        return out

    real_target = DDPMObjective.target

    def target_spy(self, latents, noise, timesteps):
        value = real_target(self, latents, noise, timesteps)
        seen.setdefault("target", value.detach().clone())
        return value

    monkeypatch.setattr(step_module, "noised", noised_spy)
    monkeypatch.setattr(step_module, "weigh", weigh_spy)
    monkeypatch.setattr(DDPMObjective, "target", target_spy)
    train(config)
    monkeypatch.undo()
    return seen


QUIET = dict(max_train_steps=1, diagnostics_every=0, activation_stats_every=0, validation_loss_every=0)


def test_the_loop_trains_on_pyramid_noise_drawn_from_the_batchs_own_generator(tiny_config, one_thread, tmp_path,
                                                                              monkeypatch):
    """The target the loop's first step trains towards (epsilon) is kohya's pyramid noise drawn from the sampler
    batch's generator, redrawn here from that generator's recorded state; off, it is the white noise alone."""
    for iterations, discount in ((0, 0.3), (6, 0.3)):
        seen = first_step_of_a_run(tiny_config(output_dir=str(tmp_path / f"p{iterations}"), **QUIET,
                                               multires_noise_iterations=iterations,
                                               multires_noise_discount=discount), monkeypatch)
        assert seen["options"] == NoiseOptions(pyramid_iterations=iterations, pyramid_discount=discount)
        generator = torch.Generator().manual_seed(0)
        generator.set_state(seen["generator_state"])
        white = torch.randn(seen["latents"].shape, generator=generator)
        want = pyramid_noise(white, generator, iterations, discount) if iterations else white
        torch.testing.assert_close(seen["target"], want.to(seen["target"].dtype), rtol=0, atol=0)


def test_the_loop_perturbs_the_input_by_gamma_and_leaves_the_target(tiny_config, one_thread, tmp_path, monkeypatch):
    """ip_noise_gamma: the same step's denoiser input moves by gamma times one fixed perturbation (twice the gamma,
    twice the move) while the target stays the same noise."""
    runs = {gamma: first_step_of_a_run(tiny_config(output_dir=str(tmp_path / f"g{gamma}"), **QUIET,
                                                   ip_noise_gamma=gamma), monkeypatch) for gamma in (0.0, 0.1, 0.2)}
    assert torch.equal(runs[0.1]["target"], runs[0.0]["target"]) and torch.equal(runs[0.2]["target"],
                                                                                   runs[0.0]["target"])
    small, large = runs[0.1]["noisy"] - runs[0.0]["noisy"], runs[0.2]["noisy"] - runs[0.0]["noisy"]
    assert float(small.abs().max()) > 1e-3
    torch.testing.assert_close(large, 2 * small, rtol=1e-4, atol=1e-5)


def test_the_loop_weighs_each_image_by_inverse_sqrt_snr_with_debiased_estimation(tiny_config, one_thread, tmp_path,
                                                                                 monkeypatch):
    """debiased_estimation_loss: each image's loss is weighted by 1/sqrt(SNR) of its own timestep (capped at 1000
    as kohya caps it); off, every weight is 1."""
    off = first_step_of_a_run(tiny_config(output_dir=str(tmp_path / "off"), **QUIET), monkeypatch)
    on = first_step_of_a_run(tiny_config(output_dir=str(tmp_path / "on"), **QUIET, debiased_estimation_loss=True),
                             monkeypatch)
    assert torch.equal(off["timesteps"], on["timesteps"])
    torch.testing.assert_close(off["weight"], torch.ones_like(off["weight"]))
    snr = on["objective"].snr(on["timesteps"]).clamp(max=1000)
    torch.testing.assert_close(on["weight"], (1 / snr.sqrt()).to(on["weight"].dtype))
