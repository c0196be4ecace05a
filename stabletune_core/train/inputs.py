"""A collated batch's denoiser inputs: its latents, its conditioning and its random generator.

Latents come from the latent cache, or are encoded now by the family's VAE (a posterior sample drawn from the
batch's own generator); text comes from the embedding cache, or is encoded now (with gradients when the text
encoders train). Each sampler batch draws from a generator seeded by (seed, epoch, place in the epoch), never by
how many batches this process drew before: what makes noise and timesteps independent of the process count, a
micro-batch shrink and a resume.
"""
from __future__ import annotations

from typing import Any

import torch

from ..data.caches import EmbeddingCache, LatentCache
from ..data.seeds import derive_seed
from ..lora.pivotal import PivotalTokens
from ..models.base import Conditioning, ModelBundle
from .amp import MixedPrecision


class BatchInputs:
    """Set up once (the caches are filled by setup's `build_caches`), then only read."""

    def __init__(self, bundle: ModelBundle, amp: MixedPrecision, device: torch.device, *, seed: int,
                 train_text_encoder: bool, pivotal: PivotalTokens | None = None) -> None:
        self.bundle, self.amp, self.device = bundle, amp, device
        self.seed = seed
        self.train_text_encoder = train_text_encoder
        self.pivotal = pivotal  # while its rows train, the text encoders run with gradients
        self.latent_cache: LatentCache | None = None
        self.text_cache: EmbeddingCache | None = None

    def generator(self, batch: dict[str, Any], purpose: str = "noise") -> torch.Generator:
        """The generator of one sampler batch's noise and timesteps (or its VAE posterior sample), seeded by
        (seed, epoch, place in the epoch) of `batch["position"]`."""
        epoch, place = batch["position"]
        return torch.Generator().manual_seed(derive_seed(purpose, self.seed, epoch, place) % 2**63)

    @torch.no_grad()
    def encode_pixels(self, pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return self.bundle.family.encode_latents(self.bundle, pixels, generator=generator)

    def encode_text(self, captions: list[str], *, grad: bool) -> dict[str, torch.Tensor]:
        """The family's text tensors, from the bundle's own encoders. With several processes their LoRA gradients
        are summed across ranks with the denoiser's (ranks.py); calling the DDP wrappers instead would broadcast
        the encoders' buffers (CLIP's position ids) inside every forward: a collective in the middle of a step,
        where a rank that ran out of memory would never meet it."""
        with torch.set_grad_enabled(grad), self.amp.autocast():
            return self.bundle.family.encode_text(self.bundle, captions)

    def latents(self, batch: dict[str, Any]) -> torch.Tensor:
        if self.latent_cache is not None:
            return self.latent_cache.get_batch(batch["index"]).to(self.device)
        return self.encode_pixels(batch["pixel_values"], self.generator(batch, "vae"))

    def conditioning(self, batch: dict[str, Any], rows: slice) -> Conditioning:
        captions = batch["caption"][rows]
        if self.text_cache is not None:
            text = {k: v.to(self.device) for k, v in self.text_cache.get_batch(captions).items()}
        else:
            grad = self.train_text_encoder or (self.pivotal is not None and self.pivotal.training)
            text = self.encode_text(captions, grad=grad)
        return self.bundle.family.make_conditioning(self.bundle, text, batch["sizes"][rows])
