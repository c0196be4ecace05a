"""A tiny but real Stable Diffusion 1.x, with random weights, for tests and demos.

The architectures are the real diffusers/transformers classes in SD's 4-level
block layout, just narrow, so everything that works on SD 1.5 (single-file
conversion, LoRA key naming, the training loop) works on this model too, in
seconds on a CPU. Everything is deterministic from ``seed``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from ..tokenizer import write_clip_tokenizer_files

#: 64x64 images -> 8x8 latents (the VAE has 4 levels, so it downscales by 8).
TINY_IMAGE_SIZE = 64

UNET_CONFIG = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    block_out_channels=(32, 32, 64, 64),
    layers_per_block=1,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32,
    attention_head_dim=2,  # like SD1's 8: the number of heads, diffusers' historical naming
    norm_num_groups=16,
    use_linear_projection=False,
)
VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    block_out_channels=(8, 16, 16, 16),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    layers_per_block=1,
    norm_num_groups=8,
    sample_size=TINY_IMAGE_SIZE,
    scaling_factor=0.18215,
)
TEXT_ENCODER_CONFIG = dict(
    vocab_size=49408,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    projection_dim=32,
    bos_token_id=0,
    eos_token_id=2,  # SD1.5's config keeps CLIP's legacy value; pooling then uses argmax(ids)
    pad_token_id=1,
)
#: model_index.json of a tiny SD 1.x or 2.x folder (the pipeline class is the same; the configs differ).
SD_MODEL_INDEX = {"_class_name": "StableDiffusionPipeline", "feature_extractor": [None, None],
                  "image_encoder": [None, None], "requires_safety_checker": False, "safety_checker": [None, None],
                  "scheduler": ["diffusers", "DDPMScheduler"], "text_encoder": ["transformers", "CLIPTextModel"],
                  "tokenizer": ["transformers", "CLIPTokenizer"], "unet": ["diffusers", "UNet2DConditionModel"],
                  "vae": ["diffusers", "AutoencoderKL"]}
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    prediction_type="epsilon",
    clip_sample=False,
    steps_offset=1,
)


def _seeded(seed: int, makers: dict[str, Callable[[], torch.nn.Module]]) -> dict[str, torch.nn.Module]:
    """Each part made right after torch.manual_seed(seed + its place in `makers`), in eval mode: a part's weights
    follow from the seed and its own config, never from how many numbers the parts before it drew."""
    parts = {}
    for offset, (name, make) in enumerate(makers.items()):
        torch.manual_seed(seed + offset)
        parts[name] = make().eval()
    return parts


def _tiny_components(seed: int, unet_config: dict, text_config: dict, scheduler_config: dict) -> dict:
    """unet, vae, text_encoder, scheduler of a one-encoder tiny SD model, deterministic from seed."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    parts = _seeded(seed, {"unet": lambda: UNet2DConditionModel(**unet_config),
                           "vae": lambda: AutoencoderKL(**VAE_CONFIG),
                           "text_encoder": lambda: CLIPTextModel(CLIPTextConfig(**text_config))})
    return {**parts, "scheduler": DDPMScheduler(**scheduler_config)}


def build_tiny_components(seed: int = 0) -> dict:
    """unet, vae, text_encoder, scheduler of the tiny SD1 model, in memory, deterministic from seed."""
    return _tiny_components(seed, UNET_CONFIG, TEXT_ENCODER_CONFIG, SCHEDULER_CONFIG)


def build_tiny_sd1(out_dir: Path, seed: int = 0) -> Path:
    """Write a complete tiny SD1 diffusers pipeline folder (random weights) and return its path."""
    return _save_pipeline(out_dir, build_tiny_components(seed), SD_MODEL_INDEX, {"tokenizer": ""})


def build_tiny_sd1_single_file(out_path: Path, seed: int = 0) -> Path:
    """Write the same tiny model as one A1111-style ``.safetensors`` checkpoint (original SD keys)."""
    from .single_file import diffusers_to_original_sd

    parts = build_tiny_components(seed)
    return _save_single_file(out_path, diffusers_to_original_sd(parts["unet"], parts["vae"], parts["text_encoder"]))


# --------------------------------------------------------------------------- SD 2.x
#: SD2's differences from SD1, kept: linear projections in the transformers, attention upcast, a gelu
#: (OpenCLIP) text encoder, v-prediction, and a tokenizer that pads with "!".
SD2_UNET_CONFIG = dict(UNET_CONFIG, attention_head_dim=(2, 4, 8, 8), use_linear_projection=True,
                       upcast_attention=True)
SD2_TEXT_ENCODER_CONFIG = dict(TEXT_ENCODER_CONFIG, hidden_act="gelu")
SD2_SCHEDULER_CONFIG = dict(SCHEDULER_CONFIG, prediction_type="v_prediction")

# --------------------------------------------------------------------------- SDXL
#: SDXL's 3-level layout (no attention in the first level, several transformer blocks deeper down),
#: size conditioning through addition_embed_type "text_time", and two text encoders whose
#: penultimate hidden states are concatenated (32 + 48 = cross_attention_dim 80). The encoders must differ
#: in width, as in the real model (768 vs 1280): diffusers' single-file loader tells them apart by it.
SDXL_TIME_EMBED_DIM = 8
SDXL_UNET_CONFIG = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    block_out_channels=(32, 64, 64),
    layers_per_block=2,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 1, 2),
    cross_attention_dim=80,
    attention_head_dim=(2, 4, 4),
    norm_num_groups=16,
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=SDXL_TIME_EMBED_DIM,
    projection_class_embeddings_input_dim=6 * SDXL_TIME_EMBED_DIM + 48,  # 6 time ids + pooled text (te2 projection)
)
SDXL_VAE_CONFIG = dict(VAE_CONFIG, scaling_factor=0.13025, force_upcast=True)
SDXL_TEXT_ENCODER_2_CONFIG = dict(TEXT_ENCODER_CONFIG, hidden_act="gelu", hidden_size=48, intermediate_size=96,
                                  projection_dim=48)


def _save_pipeline(out_dir: Path, parts: dict, model_index: dict, pads: dict[str, str]) -> Path:
    import diffusers

    from ..tokenizer import EOS

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, module in parts.items():
        module.save_pretrained(out_dir / name)
    for folder, pad in pads.items():
        write_clip_tokenizer_files(out_dir / folder, pad_token=pad or EOS)
    (out_dir / "model_index.json").write_text(
        json.dumps({"_diffusers_version": diffusers.__version__, **model_index}, indent=2))
    return out_dir


def build_tiny_sd2_components(seed: int = 0) -> dict:
    """unet, vae, text_encoder, scheduler of the tiny SD 2.x (v-prediction) model."""
    return _tiny_components(seed, SD2_UNET_CONFIG, SD2_TEXT_ENCODER_CONFIG, SD2_SCHEDULER_CONFIG)


def build_tiny_sd2(out_dir: Path, seed: int = 0) -> Path:
    """Write a complete tiny SD 2.x (v-prediction) diffusers folder and return its path."""
    from ..tokenizer import OPEN_CLIP_PAD

    return _save_pipeline(out_dir, build_tiny_sd2_components(seed), SD_MODEL_INDEX, {"tokenizer": OPEN_CLIP_PAD})


def build_tiny_sd2_single_file(out_path: Path, seed: int = 0) -> Path:
    """The tiny SD 2.x model as one A1111-style checkpoint (OpenCLIP text encoder keys)."""
    from .single_file import diffusers_to_original_sd2

    parts = build_tiny_sd2_components(seed)
    return _save_single_file(out_path, diffusers_to_original_sd2(parts["unet"], parts["vae"], parts["text_encoder"]))


def build_tiny_sdxl_components(seed: int = 0) -> dict:
    """unet, vae, text_encoder, text_encoder_2, scheduler of the tiny SDXL model."""
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    parts = _seeded(seed, {
        "unet": lambda: UNet2DConditionModel(**SDXL_UNET_CONFIG),
        "vae": lambda: AutoencoderKL(**SDXL_VAE_CONFIG),
        "text_encoder": lambda: CLIPTextModel(CLIPTextConfig(**TEXT_ENCODER_CONFIG)),
        "text_encoder_2": lambda: CLIPTextModelWithProjection(CLIPTextConfig(**SDXL_TEXT_ENCODER_2_CONFIG))})
    scheduler = EulerDiscreteScheduler(**{k: v for k, v in SCHEDULER_CONFIG.items() if k != "clip_sample"},
                                       timestep_spacing="leading")
    return {**parts, "scheduler": scheduler}


def build_tiny_sdxl(out_dir: Path, seed: int = 0) -> Path:
    """Write a complete tiny SDXL diffusers folder (random weights) and return its path."""
    from ..tokenizer import OPEN_CLIP_PAD

    index = {"_class_name": "StableDiffusionXLPipeline", "force_zeros_for_empty_prompt": True,
             "scheduler": ["diffusers", "EulerDiscreteScheduler"], "text_encoder": ["transformers", "CLIPTextModel"],
             "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
             "tokenizer": ["transformers", "CLIPTokenizer"], "tokenizer_2": ["transformers", "CLIPTokenizer"],
             "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"]}
    return _save_pipeline(out_dir, build_tiny_sdxl_components(seed), index,
                          {"tokenizer": "", "tokenizer_2": OPEN_CLIP_PAD})


def build_tiny_sdxl_single_file(out_path: Path, seed: int = 0) -> Path:
    """The tiny SDXL model as one checkpoint with SGM keys (conditioner.embedders.0/1, label_emb, ...)."""
    from .single_file import diffusers_to_original_sdxl

    parts = build_tiny_sdxl_components(seed)
    return _save_single_file(out_path, diffusers_to_original_sdxl(parts["unet"], parts["vae"], parts["text_encoder"],
                                                                  parts["text_encoder_2"]))


def _save_single_file(out_path: Path, state: dict) -> Path:
    from safetensors.torch import save_file

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_path), metadata={"format": "pt"})
    return out_path
