"""The UNet's prediction and its diffusion loss: written once, for the training step, the validation loss and
the diagnostics probe alike, so what validation measures is what training optimises."""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable

import torch

from ..models.base import Conditioning
from .loss import diffusion_loss


def predict(unet: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor, cond: Conditioning, *,
            dtype: torch.dtype, autocast: Callable[[], AbstractContextManager[Any]]) -> torch.Tensor:
    """The UNet's output for `noisy` latents (cast to the frozen model's `dtype`) at `timesteps`."""
    with autocast():
        return unet(noisy.to(dtype), timesteps, encoder_hidden_states=cond.encoder_hidden_states,
                    added_cond_kwargs=cond.added_cond_kwargs).sample


def predict_and_loss(unet: torch.nn.Module, noisy: torch.Tensor, target: torch.Tensor, timesteps: torch.Tensor,
                     cond: Conditioning, *, scheduler: Any, prediction_type: str, dtype: torch.dtype,
                     autocast: Callable[[], AbstractContextManager[Any]], snr_gamma: float | None = None,
                     debiased: bool = False, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(prediction, per-sample loss [B]) of one forward pass; loss options as in `loss.diffusion_loss`."""
    pred = predict(unet, noisy, timesteps, cond, dtype=dtype, autocast=autocast)
    loss = diffusion_loss(pred, target, scheduler, timesteps, prediction_type=prediction_type, snr_gamma=snr_gamma,
                          debiased=debiased, mask=mask)
    return pred, loss
