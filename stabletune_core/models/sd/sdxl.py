"""Stable Diffusion XL (base 1.0): two text encoders, pooled text and image sizes as extra conditioning.

What differs from SD1, all of it behind the family interface:

* text: CLIP ViT-L (``text_encoder``) and OpenCLIP ViT-bigG (``text_encoder_2``, with projection). The UNet
  sees both penultimate hidden states side by side (768 + 1280 = 2048) and the projected pooled output of
  the second encoder.
* size conditioning: six "time ids" per image, original size (h, w), crop top-left (top, left) and target
  size (h, w), which the bucketing data pipeline records per image.
* LoRA keys: ``lora_te1_`` / ``lora_te2_`` for the two encoders, and UNet modules named in the original SGM
  layout (``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q``) as kohya's sd-scripts write
  them; A1111/Forge, ComfyUI and diffusers all read that form, while kohya's own SDXL loader does not
  read diffusers-style ``lora_unet_down_blocks_...`` names.
* the VAE overflows in fp16 (its config says ``force_upcast``): the loop keeps it in fp32.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..base import Conditioning, ModelBundle
from .sd1 import CONFIGS_DIR, SD1

SDXL_BASE_CONFIG_DIR = CONFIGS_DIR / "sdxl_base"

Sizes = list[dict[str, tuple[int, int]]]


class SDXL(SD1):
    """The SDXL base family (SDXL 1.0 base, Pony/Illustrious-style fine-tunes of it)."""

    name = "sdxl"
    display_name = "Stable Diffusion XL"
    base_model_version = "sdxl_base_v1-0"
    modelspec_architecture = "stable-diffusion-xl-v1-base/lora"
    modelspec_implementation = "https://github.com/Stability-AI/generative-models"  # what kohya writes for SDXL LoRAs
    default_resolution = (1024, 1024)
    is_v2 = False
    plans_memory = True  # models/memory_plan.py (its memory model: sd/sdxl_memory.py)
    text_encoder_kohya_prefixes = ["lora_te1", "lora_te2"]
    diffusers_pipeline_class = "StableDiffusionXLPipeline"
    default_config_dir = SDXL_BASE_CONFIG_DIR
    text_encoder_parts = ("text_encoder", "text_encoder_2")
    tokenizer_parts = ("tokenizer", "tokenizer_2")
    lora_file_markers = ("sdxl", "stable-diffusion-xl")
    lora_module_prefixes = ("lora_te1_", "lora_te2_", "lora_unet_input_blocks", "lora_unet_output_blocks",
                            "lora_unet_middle_block")  # two text encoders, SGM UNet names

    # ------------------------------------------------------------------ load
    def _load_diffusers(self, where: str, local_files_only: bool, torch_dtype) -> dict[str, Any]:
        from transformers import CLIPTextModelWithProjection, CLIPTokenizer

        parts = super()._load_diffusers(where, local_files_only, torch_dtype)
        kw = {"local_files_only": local_files_only}
        parts["text_encoder_2"] = CLIPTextModelWithProjection.from_pretrained(
            where, subfolder="text_encoder_2", dtype=torch_dtype, **kw)
        parts["tokenizer_2"] = CLIPTokenizer.from_pretrained(where, subfolder="tokenizer_2", **kw)
        return parts

    def _load_single_file(self, path: Path, config_dir, local_files_only: bool, torch_dtype) -> dict[str, Any]:
        from diffusers import StableDiffusionXLPipeline

        from ..base import ModelLoadError

        config_dir = Path(config_dir) if config_dir is not None else self.single_file_config_dir(path)
        if not (config_dir / "model_index.json").is_file():
            raise ModelLoadError(f"The config folder '{config_dir}' has no model_index.json, so it cannot describe the model.")
        pipe = StableDiffusionXLPipeline.from_single_file(
            str(path), config=str(config_dir), local_files_only=True, torch_dtype=torch_dtype)
        parts = {name: getattr(pipe, name) for name in
                 ("unet", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")}
        parts["scheduler_config"] = pipe.scheduler.config
        return parts

    # ---------------------------------------------------------------- encode
    def encode_text(self, bundle: ModelBundle, prompts: list[str]) -> dict[str, torch.Tensor]:
        """{"prompt_embeds": [B, 77, 768 + 1280], "pooled_prompt_embeds": [B, 1280]}, as diffusers' SDXL
        pipeline computes them: penultimate hidden states of both encoders, pooled projection of the second."""
        from ..tokenizer import expand_multi_vector

        hidden, pooled = [], None
        for tok, te in zip(bundle.tokenizers, bundle.text_encoders):
            ids = tok(expand_multi_vector(tok, prompts), padding="max_length", max_length=tok.model_max_length,
                      truncation=True, return_tensors="pt").input_ids.to(te.device)
            out = te(ids, output_hidden_states=True)
            hidden.append(out.hidden_states[-2])
            pooled = out[0]  # the last encoder's (CLIPTextModelWithProjection) text_embeds
        return {"prompt_embeds": torch.cat(hidden, dim=-1), "pooled_prompt_embeds": pooled}

    def default_size(self, bundle: ModelBundle) -> tuple[int, int]:
        side = int(bundle.denoiser.config.sample_size) * bundle.vae_scale_factor
        return side, side

    def time_ids(self, bundle: ModelBundle, sizes: Sizes | None, n: int) -> torch.Tensor:
        """[n, 6]: original (h, w) + crop top-left (top, left) + target (h, w), one row per image."""
        if sizes is None:
            h, w = self.default_size(bundle)
            sizes = [{"original_size": (h, w), "crop_top_left": (0, 0), "target_size": (h, w)}] * n
        if len(sizes) != n:
            raise ValueError(f"Got {len(sizes)} image sizes for {n} prompts; SDXL needs one per image.")
        rows = [[*s["original_size"], *s["crop_top_left"], *s["target_size"]] for s in sizes]
        return torch.tensor(rows, dtype=torch.float32)

    def make_conditioning(self, bundle: ModelBundle, text: dict[str, torch.Tensor], sizes: Sizes | None = None
                          ) -> Conditioning:
        hidden, pooled = text["prompt_embeds"], text["pooled_prompt_embeds"]
        time_ids = self.time_ids(bundle, sizes, hidden.shape[0]).to(hidden.device, hidden.dtype)
        return Conditioning(encoder_hidden_states=hidden,
                            added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids})

    def make_pipeline(self, bundle: ModelBundle, scheduler=None):
        """A StableDiffusionXLPipeline over the bundle's own modules, for validation images."""
        from diffusers import StableDiffusionXLPipeline

        te1, te2 = bundle.text_encoders
        tok1, tok2 = bundle.tokenizers
        return StableDiffusionXLPipeline(
            vae=bundle.vae, text_encoder=te1, text_encoder_2=te2, tokenizer=tok1, tokenizer_2=tok2, unet=bundle.denoiser,
            scheduler=scheduler if scheduler is not None else bundle.noise_scheduler,
            force_zeros_for_empty_prompt=True, add_watermarker=False)

    # -------------------------------------------------------------- metadata
    def metadata(self, bundle: ModelBundle) -> dict[str, str]:
        meta = super().metadata(bundle)
        meta["ss_v2"] = "False"
        return meta

    def kohya_denoiser_name(self, module_path: str, denoiser: torch.nn.Module) -> str:
        """kohya's SDXL names: the module under its original SGM path (input_blocks_4_1_...)."""
        from ...lora.layers import unwrap
        from .single_file import kohya_sgm_unet_name

        return kohya_sgm_unet_name(module_path, unwrap(denoiser).config)

    def original_text_encoder(self, encoder):
        """CLIP's keys under SGM's conditioner.embedders.0. (SDXL's first text encoder)."""
        from . import single_file as sf

        clip = sf.convert_text_encoder_state_dict(encoder)
        return {sf.SDXL_TEXT_ENCODER_PREFIX + k.removeprefix(sf.TEXT_ENCODER_PREFIX): v for k, v in clip.items()}

    def full_original_state_dict(self, bundle: ModelBundle):
        from .single_file import diffusers_to_original_sdxl

        encoders = bundle.text_encoders
        return diffusers_to_original_sdxl(bundle.denoiser, bundle.vae, encoders[0], encoders[1])
