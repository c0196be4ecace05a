"""The diffusion training objective: noise-prediction MSE with optional min-SNR weighting."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def add_noise(scheduler, latents: torch.Tensor, generator: torch.Generator, *, noise_offset: float = 0.0,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Noisy latents, the noise and the timesteps. Random numbers come from the loop's own CPU generator so a
    resumed run draws exactly what the uninterrupted one would have."""
    batch = latents.shape[0]
    noise = torch.randn(latents.shape, generator=generator)
    if noise_offset:
        noise = noise + noise_offset * torch.randn((batch, latents.shape[1], 1, 1), generator=generator)
    timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (batch,), generator=generator)
    noise = noise.to(latents.device, latents.dtype)
    timesteps = timesteps.to(latents.device)
    return scheduler.add_noise(latents, noise, timesteps), noise, timesteps


def target_for(scheduler, prediction_type: str, latents: torch.Tensor, noise: torch.Tensor,
               timesteps: torch.Tensor) -> torch.Tensor:
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        return scheduler.get_velocity(latents, noise, timesteps)
    raise ValueError(f"Unknown prediction type {prediction_type!r}.")


def snr(scheduler, timesteps: torch.Tensor) -> torch.Tensor:
    alphas_cumprod = scheduler.alphas_cumprod.to(timesteps.device)[timesteps].float()
    return alphas_cumprod / (1 - alphas_cumprod)


def diffusion_loss(pred: torch.Tensor, target: torch.Tensor, scheduler, timesteps: torch.Tensor, *,
                   prediction_type: str, snr_gamma: float | None) -> torch.Tensor:
    """Per-sample loss (shape [B]) so callers can weight micro-batches by their size."""
    per_sample = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=(1, 2, 3))
    if snr_gamma is None:
        return per_sample
    # Min-SNR weighting (Hang et al. 2023): cap the weight of easy, low-noise timesteps.
    ratio = snr(scheduler, timesteps)
    weight = torch.clamp(ratio, max=snr_gamma) / (ratio + 1 if prediction_type == "v_prediction" else ratio)
    return per_sample * weight
