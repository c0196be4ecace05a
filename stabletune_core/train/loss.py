"""The diffusion training objective: noise-prediction MSE with optional min-SNR weighting, and the noise and
loss options users bring from kohya's sd-scripts (pyramid noise, input perturbation, debiased estimation)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def add_noise(scheduler, latents: torch.Tensor, generator: torch.Generator, *, noise_offset: float = 0.0,
              multires_noise_iterations: int = 0, multires_noise_discount: float = 0.3,
              ip_noise_gamma: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Noisy latents, the noise (the epsilon target) and the timesteps. Random numbers come from the loop's own
    CPU generator so a resumed run draws exactly what the uninterrupted one would have; an option that is off
    draws nothing, so the default run's random stream is the same as before the option existed."""
    batch = latents.shape[0]
    noise = torch.randn(latents.shape, generator=generator)
    if noise_offset:
        noise = noise + noise_offset * torch.randn((batch, latents.shape[1], 1, 1), generator=generator)
    if multires_noise_iterations:
        noise = pyramid_noise(noise, generator, multires_noise_iterations, multires_noise_discount)
    timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (batch,), generator=generator)
    # Input perturbation (Ning et al. 2023): the model sees latents noised with slightly different noise than
    # the target it must predict, which reduces the exposure bias between training and sampling.
    perturbed = noise + ip_noise_gamma * torch.randn(latents.shape, generator=generator) if ip_noise_gamma else noise
    noise = noise.to(latents.device, latents.dtype)
    perturbed = perturbed.to(latents.device, latents.dtype)
    timesteps = timesteps.to(latents.device)
    return scheduler.add_noise(latents, perturbed, timesteps), noise, timesteps


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
                   prediction_type: str, snr_gamma: float | None, debiased: bool = False,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample loss (shape [B]) so callers can weight micro-batches by their size.

    `mask` (B, 1, h, w) in [0, 1] weights each latent position (masked loss); the weighted mean is divided by
    the mask's mean, so a half-masked image does not count half as much. An all-black mask gives 0.
    """
    per_element = F.mse_loss(pred.float(), target.float(), reduction="none")
    if mask is None:
        per_sample = per_element.mean(dim=(1, 2, 3))
    else:
        mask = mask.to(per_element.device, torch.float32)
        per_sample = (per_element * mask).mean(dim=(1, 2, 3)) / mask.mean(dim=(1, 2, 3)).clamp_min(1e-8)
    if snr_gamma is not None:
        # Min-SNR weighting (Hang et al. 2023): cap the weight of easy, low-noise timesteps.
        ratio = snr(scheduler, timesteps)
        weight = torch.clamp(ratio, max=snr_gamma) / (ratio + 1 if prediction_type == "v_prediction" else ratio)
        per_sample = per_sample * weight
    if debiased:
        per_sample = per_sample * debiased_weight(scheduler, timesteps, prediction_type)
    return per_sample


def debiased_weight(scheduler, timesteps: torch.Tensor, prediction_type: str) -> torch.Tensor:
    """Debiased estimation (Yu et al. 2023, as kohya's sd-scripts apply it): weight 1/sqrt(SNR) (v-prediction:
    1/(SNR+1)), SNR capped at 1000 so the first timesteps do not vanish entirely."""
    ratio = torch.clamp(snr(scheduler, timesteps), max=1000)
    return 1 / (ratio + 1) if prediction_type == "v_prediction" else 1 / ratio.sqrt()


def prior_weights(is_reg: list[bool], prior_loss_weight: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """Per-sample loss weights: 1 for instance images, prior_loss_weight for regularisation (class) images."""
    return torch.tensor([prior_loss_weight if reg else 1.0 for reg in is_reg], device=device)


class LossParts:
    """The step's unweighted loss split into instance and prior (regularisation) images, for the metrics.

    A part no image of the step belongs to is left out, never logged as NaN or 0.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._sums = {"loss_instance": 0.0, "loss_prior": 0.0}
        self._counts = {"loss_instance": 0, "loss_prior": 0}

    def add(self, per_sample: torch.Tensor, is_reg: list[bool]) -> None:
        for value, reg in zip(per_sample.detach().float().tolist(), is_reg, strict=True):
            name = "loss_prior" if reg else "loss_instance"
            self._sums[name] += value
            self._counts[name] += 1

    def means(self) -> dict[str, float]:
        return {name: self._sums[name] / count for name, count in self._counts.items() if count}
