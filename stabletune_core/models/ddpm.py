"""The DDPM training objective of Stable Diffusion 1.x, 2.x and XL: a UNet predicts the noise (epsilon) or the
velocity (v-prediction) of latents noised by a discrete schedule of `num_train_timesteps` steps, with the loss
weightings users bring from kohya's sd-scripts (min-SNR, debiased estimation).

Everything here reads the family's noise scheduler (diffusers' DDPMScheduler); a flow-matching family brings its
own objective with the same methods (models/base.py `Objective`).
"""
from __future__ import annotations

from typing import Any

import torch

from .base import Conditioning, ModelLoadError


class DDPMObjective:
    def __init__(self, scheduler: Any, *, snr_gamma: float | None = None, debiased: bool = False) -> None:
        self.scheduler = scheduler
        self.prediction_type = scheduler.config.prediction_type
        if self.prediction_type not in ("epsilon", "v_prediction"):
            raise ModelLoadError(f"The model's scheduler predicts {self.prediction_type!r}, which StableTune does not "
                                 "train; set prediction_type to epsilon or v_prediction.")
        self.snr_gamma = snr_gamma
        self.debiased = debiased

    @property
    def num_train_timesteps(self) -> int:
        return int(self.scheduler.config.num_train_timesteps)

    # ---- the training sample -----------------------------------------------------------------------------------
    def draw_timesteps(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randint(0, self.num_train_timesteps, (batch,), generator=generator)

    def noisy_input(self, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.scheduler.add_noise(latents, noise, t)

    def target(self, latents: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if self.prediction_type == "epsilon":
            return noise
        return self.scheduler.get_velocity(latents, noise, t)

    def predict(self, denoiser: torch.nn.Module, noisy: torch.Tensor, t: torch.Tensor,
                cond: Conditioning) -> torch.Tensor:
        return denoiser(noisy, t, encoder_hidden_states=cond.encoder_hidden_states,
                        added_cond_kwargs=cond.added_cond_kwargs).sample

    # ---- the loss weights ----------------------------------------------------------------------------------------
    def snr(self, t: torch.Tensor) -> torch.Tensor:
        """Signal-to-noise ratio alpha_bar / (1 - alpha_bar) of each timestep."""
        alphas_cumprod = self.scheduler.alphas_cumprod.to(t.device)[t].float()
        return alphas_cumprod / (1 - alphas_cumprod)

    def loss_weight(self, t: torch.Tensor) -> torch.Tensor | None:
        """Min-SNR (Hang et al. 2023: cap the weight of easy, low-noise timesteps at snr_gamma) and/or debiased
        estimation (Yu et al. 2023, as sd-scripts: 1/sqrt(SNR), v-prediction 1/(SNR+1), SNR capped at 1000)."""
        weight = None
        v = self.prediction_type == "v_prediction"
        if self.snr_gamma is not None:
            ratio = self.snr(t)
            weight = torch.clamp(ratio, max=self.snr_gamma) / (ratio + 1 if v else ratio)
        if self.debiased:
            ratio = torch.clamp(self.snr(t), max=1000)
            debiased = 1 / (ratio + 1) if v else 1 / ratio.sqrt()
            weight = debiased if weight is None else weight * debiased
        return weight

    # ---- reading a prediction, fixed timesteps ------------------------------------------------------------------
    def predicted_clean(self, noisy: torch.Tensor, prediction: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        alphas = self.scheduler.alphas_cumprod.to(noisy.device)[t].float()
        a = alphas.sqrt().view(-1, 1, 1, 1)
        b = (1 - alphas).sqrt().view(-1, 1, 1, 1)
        noisy, prediction = noisy.float(), prediction.float()
        if self.prediction_type == "epsilon":
            return (noisy - b * prediction) / a
        return a * noisy - b * prediction

    def validation_timesteps(self, count: int) -> torch.Tensor:
        """Centred in `count` equal bins of the schedule: no 0, no T-1 extremes (count 1: T/2)."""
        total = self.num_train_timesteps
        return torch.tensor([int((k + 0.5) * total / count) for k in range(count)], dtype=torch.long)

    def noise_level(self, t: torch.Tensor) -> torch.Tensor:
        return t.float() / self.num_train_timesteps
