"""Noise and loss options from kohya's sd-scripts: pyramid noise, input perturbation, debiased estimation."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import DDPMScheduler

from stabletune_core.models.ddpm import DDPMObjective
from stabletune_core.train.loss import per_sample_loss
from stabletune_core.train.noise import NoiseOptions, noised


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


@pytest.mark.parametrize("knob", [{"multires_noise_iterations": 6, "multires_noise_discount": 0.3},
                                  {"ip_noise_gamma": 0.1}, {"debiased_estimation_loss": True}])
def test_the_loop_uses_each_option(tiny_config, one_thread, knob, tmp_path):
    """The first step's loss (same weights, batch and random stream) changes when an option is on."""
    from stabletune_core.train.loop import train

    quiet = dict(max_train_steps=1, diagnostics_every=0, activation_stats_every=0, validation_loss_every=0)
    first = {}
    for name, extra in (("off", {}), ("on", knob)):
        config = tiny_config(output_dir=str(tmp_path / name), **quiet, **extra)
        train(config)
        first[name] = json.loads((Path(config.output_dir) / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert first["on"] != pytest.approx(first["off"], rel=1e-4)
