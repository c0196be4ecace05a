"""The seam a flow-matching family plugs into (issue 22 A): the step asks the family's objective how to draw
timesteps, noise the latents, what to predict and how to weight the loss; nothing outside models/ knows which
objective it is."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from stabletune_core.models.base import Conditioning


class RectifiedFlow:
    """A standalone flow-matching objective, shaped as the FLUX.2 Klein one will be: t in [0, 1] (1 = noise),
    x_t = (1 - t) x + t n, the model predicts the velocity n - x; the UNet is told t x 1000."""

    def __init__(self) -> None:
        self.calls: set[str] = set()

    def draw_timesteps(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        self.calls.add("draw_timesteps")
        return torch.sigmoid(torch.randn(batch, generator=generator))  # logit-normal, as SD3/FLUX train

    def noisy_input(self, latents, noise, t):
        self.calls.add("noisy_input")
        t = t.view(-1, 1, 1, 1).to(latents.dtype)
        return (1 - t) * latents + t * noise

    def target(self, latents, noise, t):
        self.calls.add("target")
        return noise - latents

    def loss_weight(self, t):
        self.calls.add("loss_weight")
        return None

    def predict(self, denoiser, noisy, t, cond: Conditioning):
        self.calls.add("predict")
        return denoiser(noisy, t * 1000, encoder_hidden_states=cond.encoder_hidden_states).sample

    def predicted_clean(self, noisy, prediction, t):
        return noisy.float() - t.view(-1, 1, 1, 1) * prediction.float()

    def validation_timesteps(self, count: int) -> torch.Tensor:
        return torch.tensor([(k + 0.5) / count for k in range(count)])

    def noise_level(self, t):
        return t.float()


def test_a_flow_objective_trains_through_the_same_step(tiny_config, one_thread, monkeypatch):
    from stabletune_core.models.sd.sd1 import SD1
    from stabletune_core.train.loop import train

    flow = RectifiedFlow()
    monkeypatch.setattr(SD1, "objective", lambda self, bundle, options: flow)
    config = tiny_config(max_train_steps=3, validation_loss_every=3, validation_timesteps=4, diagnostics_every=0,
                         activation_stats_every=3)
    train(config)
    assert flow.calls == {"draw_timesteps", "noisy_input", "target", "loss_weight", "predict"}
    lines = [json.loads(line) for line in (Path(config.output_dir) / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in lines)
    assert lines[-1]["val_loss"] > 0  # measured at the objective's own fixed timesteps


def test_the_sd_objective_is_the_ddpm_schedule(tiny_model):
    from stabletune_core.config import build_config
    from stabletune_core.models import get_family

    family = get_family("sd1")
    bundle = family.load(str(tiny_model))
    objective = family.objective(bundle, build_config({}))
    scheduler = bundle.noise_scheduler
    g = torch.Generator().manual_seed(0)
    latents, noise = torch.randn(3, 4, 8, 8, generator=g), torch.randn(3, 4, 8, 8, generator=g)
    t = objective.draw_timesteps(3, torch.Generator().manual_seed(1))
    assert torch.equal(t, torch.randint(0, 1000, (3,), generator=torch.Generator().manual_seed(1)))
    assert torch.equal(objective.noisy_input(latents, noise, t), scheduler.add_noise(latents, noise, t))
    assert torch.equal(objective.target(latents, noise, t), noise) and objective.loss_weight(t) is None
    assert objective.validation_timesteps(3).tolist() == [166, 500, 833]
    pixels = torch.rand(1, 3, 32, 32, generator=g) * 2 - 1
    latents = family.encode_latents(bundle, pixels)
    raw = bundle.vae.encode(pixels).latent_dist.mean
    assert torch.equal(latents, raw * bundle.vae.config.scaling_factor)  # SD: shift 0
    torch.testing.assert_close(family.decode_latents(bundle, latents), bundle.vae.decode(raw).sample)
