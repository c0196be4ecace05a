"""The noise of a training sample, the same for every model family: white noise, with the options users bring
from kohya's sd-scripts (noise offset, pyramid noise, input perturbation); the family's objective draws the
timesteps and noises the latents with it (models/base.py `Objective`).

Random numbers come from the sampler batch's own CPU generator (step.py), always in the same order (noise, offset,
pyramid, timesteps, perturbation), so a resumed run draws exactly what the uninterrupted one would have; an option
that is off draws nothing, so the default run's random stream is the same as before the option existed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..models.base import Objective


@dataclass(frozen=True)
class NoiseOptions:
    offset: float = 0.0  # noise_offset
    pyramid_iterations: int = 0  # multires_noise_iterations
    pyramid_discount: float = 0.3  # multires_noise_discount
    input_perturbation: float = 0.0  # ip_noise_gamma

    @classmethod
    def from_config(cls, config: Any) -> "NoiseOptions":
        return cls(offset=config.noise_offset, pyramid_iterations=config.multires_noise_iterations,
                   pyramid_discount=config.multires_noise_discount, input_perturbation=config.ip_noise_gamma)


def noised(objective: Objective, latents: torch.Tensor, generator: torch.Generator,
           options: NoiseOptions = NoiseOptions()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(noisy latents, the noise, the timesteps) of one sampler batch; the target is `objective.target(latents,
    noise, timesteps)`."""
    batch = latents.shape[0]
    noise = torch.randn(latents.shape, generator=generator)
    if options.offset:
        noise = noise + options.offset * torch.randn((batch, latents.shape[1], 1, 1), generator=generator)
    if options.pyramid_iterations:
        noise = pyramid_noise(noise, generator, options.pyramid_iterations, options.pyramid_discount)
    timesteps = objective.draw_timesteps(batch, generator)
    # Input perturbation (Ning et al. 2023): the model sees latents noised with slightly different noise than
    # the target it must predict, which reduces the exposure bias between training and sampling.
    gamma = options.input_perturbation
    perturbed = noise + gamma * torch.randn(latents.shape, generator=generator) if gamma else noise
    noise = noise.to(latents.device, latents.dtype)
    perturbed = perturbed.to(latents.device, latents.dtype)
    timesteps = timesteps.to(latents.device)
    return objective.noisy_input(latents, perturbed, timesteps), noise, timesteps


def pyramid_noise(noise: torch.Tensor, generator: torch.Generator, iterations: int, discount: float) -> torch.Tensor:
    """Multi-resolution ("pyramid") noise exactly as kohya's sd-scripts make it: to the white noise add, for
    level 0..iterations-1, noise drawn at a grid 2-4x coarser per level (a random factor), upsampled and
    weighted discount**level; then normalise to unit std. The extra low-frequency energy lets the model change
    an image's overall colour and layout."""
    b, c, h, w = noise.shape
    for level in range(iterations):
        factor = float(torch.rand((), generator=generator)) * 2 + 2
        hn, wn = max(1, int(h / factor ** level)), max(1, int(w / factor ** level))
        coarse = torch.randn((b, c, hn, wn), generator=generator)
        noise = noise + F.interpolate(coarse, size=(h, w), mode="bilinear") * discount ** level
        if hn == 1 or wn == 1:
            break
    return noise / noise.std()
