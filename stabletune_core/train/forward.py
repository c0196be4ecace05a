"""The denoiser's prediction and its loss: written once, for the training step, the validation loss and the
diagnostics probe alike, so what validation measures is what training optimises."""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable

import torch

from ..models.base import Conditioning, Objective
from .loss import per_sample_loss


def predict(objective: Objective, denoiser: torch.nn.Module, noisy: torch.Tensor, timesteps: torch.Tensor,
            cond: Conditioning, *, dtype: torch.dtype, autocast: Callable[[], AbstractContextManager[Any]]
            ) -> torch.Tensor:
    """The denoiser's output for `noisy` latents (cast to the frozen model's `dtype`) at `timesteps`."""
    with autocast():
        return objective.predict(denoiser, noisy.to(dtype), timesteps, cond)


def predict_and_loss(objective: Objective, denoiser: torch.nn.Module, noisy: torch.Tensor, target: torch.Tensor,
                     timesteps: torch.Tensor, cond: Conditioning, *, dtype: torch.dtype,
                     autocast: Callable[[], AbstractContextManager[Any]], weighted: bool = False,
                     mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(prediction, per-sample loss [B]) of one forward pass. `weighted`: times the objective's loss weights
    (training); the validation loss and probes leave them out."""
    prediction = predict(objective, denoiser, noisy, timesteps, cond, dtype=dtype, autocast=autocast)
    loss = per_sample_loss(prediction, target, mask)
    return prediction, weigh(objective, loss, timesteps) if weighted else loss


def weigh(objective: Objective, loss: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """A per-sample loss times the objective's loss weights at its timesteps (min-SNR and the like)."""
    weight = objective.loss_weight(timesteps)
    return loss if weight is None else loss * weight
