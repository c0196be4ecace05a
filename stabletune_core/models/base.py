"""The one face every model family shows to the loop, the exporter and the UI.

A family (sd1, sd2, sdxl) is one module that builds a `ModelFamily` object. The
loop never asks "is this SDXL?": it asks the family to load, to encode prompts
and to name its LoRA keys.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class Conditioning:
    """What the UNet needs besides the noisy latents and the timesteps."""

    encoder_hidden_states: torch.Tensor
    added_cond_kwargs: dict[str, torch.Tensor] | None = None

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "Conditioning":
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype) if dtype is not None and t.is_floating_point() else t.to(device)

        extra = {k: move(v) for k, v in self.added_cond_kwargs.items()} if self.added_cond_kwargs else None
        return Conditioning(move(self.encoder_hidden_states), extra)

    def index(self, rows: slice | list[int] | torch.Tensor) -> "Conditioning":
        extra = {k: v[rows] for k, v in self.added_cond_kwargs.items()} if self.added_cond_kwargs else None
        return Conditioning(self.encoder_hidden_states[rows], extra)

    @staticmethod
    def cat(parts: list["Conditioning"]) -> "Conditioning":
        hidden = torch.cat([p.encoder_hidden_states for p in parts])
        extra = None
        if parts[0].added_cond_kwargs:
            extra = {k: torch.cat([p.added_cond_kwargs[k] for p in parts]) for k in parts[0].added_cond_kwargs}
        return Conditioning(hidden, extra)


@dataclass
class ModelBundle:
    """Everything a family loads. Modules are on CPU in fp32 until the loop places them."""

    family: "ModelFamily"
    unet: Any  # diffusers.UNet2DConditionModel
    vae: Any  # diffusers.AutoencoderKL
    text_encoders: list[Any]  # transformers CLIPTextModel / CLIPTextModelWithProjection
    tokenizers: list[Any]  # transformers CLIPTokenizer
    noise_scheduler: Any  # diffusers.DDPMScheduler
    source: str  # what the user pointed at; goes into ss_sd_model_name
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prediction_type(self) -> str:
        return self.noise_scheduler.config.prediction_type

    @property
    def vae_scale_factor(self) -> int:
        """How much the VAE downscales. Never assume 8: tiny test VAEs differ."""
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def latent_scaling(self) -> float:
        return float(self.vae.config.scaling_factor)


class ModelFamily(Protocol):
    """The interface of one model family module."""

    name: str  # "sd1", "sd2", "sdxl"
    base_model_version: str  # ss_base_model_version, e.g. "sd_v1"
    modelspec_architecture: str  # e.g. "stable-diffusion-v1/lora"
    unet_lora_targets: list[str]  # module name suffixes in the UNet that get LoRA
    text_encoder_lora_targets: list[str]
    text_encoder_kohya_prefixes: list[str]  # one per text encoder: ["lora_te"] or ["lora_te1", "lora_te2"]

    def load(self, source: str, *, local_files_only: bool = True) -> ModelBundle: ...

    def encode_text(self, bundle: ModelBundle, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Text-encoder outputs, batch first; what a text-embedding cache stores."""
        ...

    def make_conditioning(self, bundle: ModelBundle, text: dict[str, torch.Tensor],
                          sizes: list[dict[str, tuple[int, int]]]) -> Conditioning:
        """UNet conditioning from text outputs plus per-image sizes (SDXL's time ids; SD1/2 ignore them).
        sizes: one {"original_size": (h, w), "crop_top_left": (top, left), "target_size": (h, w)} per row."""
        ...

    def encode_prompts(
        self, bundle: ModelBundle, prompts: list[str], *, sizes: list[dict[str, tuple[int, int]]] | None = None
    ) -> Conditioning: ...

    def make_pipeline(self, bundle: ModelBundle, scheduler: Any) -> Any:
        """A diffusers inference pipeline sharing the bundle's modules (for validation images)."""
        ...

    def metadata(self, bundle: ModelBundle) -> dict[str, str]: ...

    # What the loop uses: text encoding split from conditioning so the text can be cached.
    def encode_text(self, bundle: ModelBundle, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Per-prompt tensors (dim 0 = prompt) that make_conditioning turns into a Conditioning."""
        ...

    def make_conditioning(self, bundle: ModelBundle, text: dict[str, torch.Tensor], sizes: Any = None) -> Conditioning: ...

    def make_pipeline(self, bundle: ModelBundle, scheduler: Any = None) -> Any:
        """A diffusers pipeline over the bundle's modules, for validation images."""
        ...


class ModelLoadError(Exception):
    """A model could not be loaded; the message is one sentence a user can act on."""
