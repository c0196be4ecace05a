"""The per-sample training loss, the same for every family: mean squared error between the denoiser's
prediction and the objective's target, optionally masked; the family's objective weights it (min-SNR, ...), the
step weights regularisation images by prior_loss_weight."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def per_sample_loss(prediction: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Mean squared error per sample (shape [B]), so callers can weight micro-batches by their size.

    `mask` (B, 1, h, w) in [0, 1] weights each latent position (masked loss); the weighted mean is divided by
    the mask's mean, so a half-masked image does not count half as much. An all-black mask gives 0.
    """
    per_element = F.mse_loss(prediction.float(), target.float(), reduction="none")
    if mask is None:
        return per_element.mean(dim=(1, 2, 3))
    mask = mask.to(per_element.device, torch.float32)
    return (per_element * mask).mean(dim=(1, 2, 3)) / mask.mean(dim=(1, 2, 3)).clamp_min(1e-8)


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
