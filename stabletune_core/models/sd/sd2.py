"""Stable Diffusion 2.x: one OpenCLIP ViT-H/14 text encoder, 512 px epsilon (2.x-base) or 768 px v-prediction.

The diffusers layout is SD1's (same pipeline class, same 4-level UNet, same LoRA key names), so this family
is SD1 with other numbers: linear projections and a 1024-wide cross-attention, a text encoder whose last
layer diffusers already dropped (its last hidden state *is* OpenCLIP's penultimate layer, what SD2 was
trained on), a tokenizer that pads with "!", and a prediction type that decides the kohya version string:
``sd_v2`` for 2.x-base (epsilon), ``sd_v2_v`` for the 768-v models.
"""
from __future__ import annotations

from pathlib import Path

from ..base import ModelBundle
from .sd1 import CONFIGS_DIR, SD1

SD21_CONFIG_DIR = CONFIGS_DIR / "sd21"  # stabilityai/stable-diffusion-2-1: 768 px, v-prediction
SD21_BASE_CONFIG_DIR = CONFIGS_DIR / "sd21_base"  # stabilityai/stable-diffusion-2-1-base: 512 px, epsilon


def is_v_prediction(bundle: ModelBundle) -> bool:
    return bundle.prediction_type == "v_prediction"


class SD2(SD1):
    """The Stable Diffusion 2.x family (2.0, 2.1, their -base versions and fine-tunes)."""

    name = "sd2"
    display_name = "Stable Diffusion 2.x"
    is_v2 = True
    default_config_dir = SD21_CONFIG_DIR
    # Until a model is loaded the family describes the common 768-v model; load() and metadata() follow the
    # prediction type the model (or the prediction_type knob) actually has.
    base_model_version = "sd_v2_v"
    modelspec_architecture = "stable-diffusion-v2-768-v/lora"
    default_resolution = (768, 768)
    lora_file_markers = ("sd_v2", "stable-diffusion-v2")

    def load(self, source, *, local_files_only: bool = True, config_dir=None, torch_dtype=None, **kw) -> ModelBundle:
        import torch

        bundle = super().load(source, local_files_only=local_files_only, config_dir=config_dir,
                              torch_dtype=torch_dtype or torch.float32)
        self.describe(bundle)
        return bundle

    def describe(self, bundle: ModelBundle) -> None:
        """Set the version strings from the bundle's prediction type (call again after overriding it)."""
        v = is_v_prediction(bundle)
        self.base_model_version = "sd_v2_v" if v else "sd_v2"
        self.modelspec_architecture = f"stable-diffusion-v2-{'768-v' if v else '512'}/lora"
        self.default_resolution = (768, 768) if v else (512, 512)

    def single_file_config_dir(self, path: Path) -> Path:
        """A single file does not say whether it predicts v or noise. Stability's own names do
        (v2-1_512-ema-pruned vs v2-1_768-ema-pruned), so "512" or "base" in the name picks 2.1-base and
        anything else the 768-v model; the prediction_type knob or model_config_dir override it."""
        stem = path.stem.lower()
        return SD21_BASE_CONFIG_DIR if ("512" in stem or "base" in stem) else SD21_CONFIG_DIR

    def metadata(self, bundle: ModelBundle) -> dict[str, str]:
        self.describe(bundle)
        return super().metadata(bundle)

    def original_text_encoder(self, encoder):
        """OpenCLIP's keys, as SD 2.x single files store its text encoder."""
        from .single_file import OPEN_CLIP_PREFIX_SD2, convert_open_clip_text_encoder

        return convert_open_clip_text_encoder(encoder, OPEN_CLIP_PREFIX_SD2)

    def full_original_state_dict(self, bundle: ModelBundle):
        from .single_file import diffusers_to_original_sd2

        return diffusers_to_original_sd2(bundle.denoiser, bundle.vae, bundle.text_encoders[0])
