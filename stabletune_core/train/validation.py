"""Loss on a fixed batch with fixed noise and timesteps: a number that is comparable across steps and resumes."""
from __future__ import annotations

from typing import Any

import torch

from .loss import add_noise, diffusion_loss, target_for


@torch.no_grad()
def fixed_batch_loss(s: Any, batch: dict[str, Any], *, seed: int = 1234) -> float:
    """Mean loss of `batch` with noise and timesteps drawn from `seed` alone (LoRA dropout off).

    The loop's own generator is not touched, so measuring never changes the training trajectory.
    """
    from .loop import conditioning_for, latents_for

    unet = s.trained["unet"]
    was_training = unet.training
    unet.eval()
    try:
        latents = latents_for(s, batch)
        generator = torch.Generator().manual_seed(seed)
        noisy, noise, timesteps = add_noise(s.bundle.noise_scheduler, latents, generator)
        target = target_for(s.bundle.noise_scheduler, s.bundle.prediction_type, latents, noise, timesteps)
        rows = slice(0, latents.shape[0])
        cond = conditioning_for(s, batch, rows)
        with s.accelerator.autocast():
            pred = unet(noisy.to(s.weight_dtype), timesteps, encoder_hidden_states=cond.encoder_hidden_states,
                        added_cond_kwargs=cond.added_cond_kwargs).sample
        loss = diffusion_loss(pred, target, s.bundle.noise_scheduler, timesteps,
                              prediction_type=s.bundle.prediction_type, snr_gamma=None)
        return float(loss.mean())
    finally:
        unet.train(was_training)
