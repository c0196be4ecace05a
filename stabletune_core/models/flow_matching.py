"""The rectified-flow (flow-matching) training objective of FLUX.2 Klein, as diffusers' Klein LoRA script trains it.

A clean latent x0 and Gaussian noise eps are mixed along a straight line, x_t = (1 - sigma) x0 + sigma eps, and the
model predicts the velocity along that line, v = eps - x0. Which sigmas a step sees, and how much each one counts,
are the SD3-paper schemes of diffusers' ``training_utils`` that ``train_dreambooth_lora_flux2_klein.py`` offers:

* timestep density: ``none`` (uniform), ``logit_normal`` (sigmoid of a normal draw), ``mode`` (mass around the
  middle, ``mode_scale``); ``sigma_sqrt`` and ``cosmap`` draw uniformly and weight the loss instead;
* the draw u in [0, 1) picks one of the scheduler's ``num_train_timesteps`` training sigmas, which carry the
  scheduler's static ``shift`` (none when the scheduler shifts dynamically at sampling time, as Klein's does);
* the transformer receives ``timestep / 1000`` (it multiplies by 1000 itself).

Every random number comes from the generator the caller passes, so a resumed run draws what the uninterrupted
one would have. How the denoiser is called (packing latents into tokens, position ids) belongs to the model
family and is handed in as ``call_denoiser``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

# The timestep densities and loss weightings of diffusers' compute_density_for_timestep_sampling /
# compute_loss_weighting_for_sd3 (the Klein example's --weighting_scheme), named once for the knob and this objective.
from ..config.families import WEIGHTING_SCHEMES

#: The transformer's timestep input is the schedule's timestep / 1000, whatever num_train_timesteps is.
TIMESTEP_INPUT_SCALE = 1000.0


@dataclass(frozen=True)
class FlowMatching:
    """x_t = (1 - sigma) x0 + sigma eps; target v = eps - x0; sigmas drawn and weighted by a scheme."""

    num_train_timesteps: int = 1000
    shift: float = 1.0
    weighting_scheme: str = "none"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    call_denoiser: Callable[..., torch.Tensor] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.weighting_scheme not in WEIGHTING_SCHEMES:
            raise ValueError(f"weighting_scheme must be one of {', '.join(WEIGHTING_SCHEMES)}, "
                             f"not '{self.weighting_scheme}'.")
        if self.shift <= 0:
            raise ValueError(f"shift must be positive, not {self.shift}.")

    @classmethod
    def from_scheduler(cls, scheduler_config: Any, **scheme: Any) -> "FlowMatching":
        """The objective a FlowMatchEulerDiscreteScheduler config implies (as diffusers' example trains with it):
        its training table is shifted only when the scheduler does not shift dynamically at sampling time."""
        get = scheduler_config.get if isinstance(scheduler_config, dict) else lambda k, d=None: getattr(
            scheduler_config, k, d)
        dynamic = bool(get("use_dynamic_shifting", False))
        return cls(num_train_timesteps=int(get("num_train_timesteps", 1000)),
                   shift=1.0 if dynamic else float(get("shift", 1.0)), **scheme)

    @classmethod
    def for_run(cls, scheduler_config: Any, options: Any, call_denoiser: Callable[..., torch.Tensor]
                ) -> "FlowMatching":
        """The objective of a flow family's run: its scheduler's table, drawn and weighted as `options` (the
        TrainConfig) asks (weighting_scheme, logit_mean, logit_std, mode_scale, flow_shift)."""
        config = dict(scheduler_config)
        if options.flow_shift is not None:  # an explicit shift is the user's: the table uses it, dynamic or not
            config.update(shift=options.flow_shift, use_dynamic_shifting=False)
        return cls.from_scheduler(config, call_denoiser=call_denoiser, weighting_scheme=options.weighting_scheme,
                                  logit_mean=options.logit_mean, logit_std=options.logit_std,
                                  mode_scale=options.mode_scale)

    # ------------------------------------------------------------------ the training table
    def schedule(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(timesteps, sigmas), float32, descending: the scheduler's training table, computed the same way."""
        n = self.num_train_timesteps
        steps = torch.from_numpy(np.linspace(1, n, n, dtype=np.float32)[::-1].copy())
        sigmas = steps / n
        sigmas = self.shift * sigmas / (1 + (self.shift - 1) * sigmas)
        return sigmas * n, sigmas

    def draw_u(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """The scheme's u in [0, 1] per row, with the same random calls as compute_density_for_timestep_sampling."""
        if self.weighting_scheme == "logit_normal":
            u = torch.normal(mean=self.logit_mean, std=self.logit_std, size=(batch,), generator=generator)
            return torch.sigmoid(u)
        u = torch.rand(size=(batch,), generator=generator)
        if self.weighting_scheme == "mode":
            u = 1 - u - self.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
        return u

    def draw_timesteps(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """[batch] training timesteps (float32, CPU). The example indexes its table with int(u x N); a u of exactly
        1 (the mode density's value at a draw of 0) would fall off the table, so the index is clamped."""
        timesteps, _ = self.schedule()
        index = (self.draw_u(batch, generator) * self.num_train_timesteps).long()
        return timesteps[index.clamp(0, self.num_train_timesteps - 1)]

    def sigmas(self, timesteps: torch.Tensor) -> torch.Tensor:
        """[B] float32 sigma of each training timestep (looked up in the table, as the example's get_sigmas)."""
        table_t, table_s = self.schedule()
        t = timesteps.detach().to("cpu", torch.float32).reshape(-1)
        hits = t[:, None] == table_t[None, :]
        if not bool(hits.any(dim=1).all()):
            raise ValueError("A timestep is not one of the training table's; draw them with draw_timesteps.")
        return table_s[hits.int().argmax(dim=1)].to(timesteps.device)

    # ------------------------------------------------------------------ the path and the target
    def add_noise(self, latents: torch.Tensor, generator: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(noisy latents, noise, timesteps): noise first, then timesteps, both from `generator` (on the CPU)."""
        noise = torch.randn(latents.shape, generator=generator).to(latents.device, latents.dtype)
        timesteps = self.draw_timesteps(latents.shape[0], generator).to(latents.device)
        return self.noisy_input(latents, noise, timesteps), noise, timesteps

    def noisy_input(self, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        sigma = _per_row(self.sigmas(timesteps).to(latents.dtype), latents.ndim)
        return (1.0 - sigma) * latents + sigma * noise

    @staticmethod
    def target(latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor | None = None) -> torch.Tensor:
        """The velocity of the straight path from the data to the noise."""
        return noise - latents

    @staticmethod
    def model_timestep(timesteps: torch.Tensor) -> torch.Tensor:
        return timesteps / TIMESTEP_INPUT_SCALE

    def loss_weight(self, timesteps: torch.Tensor) -> torch.Tensor | None:
        """[B] float32 weight of each row's loss (compute_loss_weighting_for_sd3's formulas); None where every
        weight is 1 (the schemes that only shape the draw), as models/base.py `Objective` allows."""
        if self.weighting_scheme not in ("sigma_sqrt", "cosmap"):
            return None
        sigmas = self.sigmas(timesteps).float()
        if self.weighting_scheme == "sigma_sqrt":
            return sigmas ** -2.0
        if self.weighting_scheme == "cosmap":
            return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas ** 2))
        return torch.ones_like(sigmas)

    def loss(self, pred: torch.Tensor, target: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """Per-row weighted MSE, shape [B], in float32 (the example's loss before its batch mean)."""
        weight = self.loss_weight(timesteps)
        weight = _per_row(weight.to(pred.device), pred.ndim) if weight is not None else 1.0
        return (weight * (pred.float() - target.float()) ** 2).reshape(pred.shape[0], -1).mean(dim=1)

    # ------------------------------------------------------------------ reading a prediction, fixed timesteps
    def predicted_clean(self, noisy: torch.Tensor, prediction: torch.Tensor, timesteps: torch.Tensor
                        ) -> torch.Tensor:
        """x0 = x_t - sigma v: the clean latents the predicted velocity implies (fp32)."""
        sigma = _per_row(self.sigmas(timesteps).float().to(noisy.device), noisy.ndim)
        return noisy.float() - sigma * prediction.float()

    def validation_timesteps(self, count: int) -> torch.Tensor:
        """`count` timesteps of the training table, centred in `count` equal bins of sigma (no pure noise, no clean
        image), as DDPM's are centred in bins of its schedule."""
        timesteps, _ = self.schedule()
        n = self.num_train_timesteps
        return torch.stack([timesteps[n - 1 - int((k + 0.5) * n / count)] for k in range(count)])

    def noise_level(self, timesteps: torch.Tensor) -> torch.Tensor:
        """sigma: 0 = clean, 1 = pure noise."""
        return self.sigmas(timesteps).float()

    # ------------------------------------------------------------------ the model
    def predict(self, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor, cond: Any
                ) -> torch.Tensor:
        """The denoiser's velocity for `noisy` latents, in their [B, C, H, W] layout."""
        if self.call_denoiser is None:
            raise RuntimeError("This FlowMatching objective has no call_denoiser; build it with the family's "
                               "objective().")
        return self.call_denoiser(denoiser, noisy, self.model_timestep(timesteps), cond)


def _per_row(values: torch.Tensor, ndim: int) -> torch.Tensor:
    return values.reshape(-1, *([1] * (ndim - 1)))
