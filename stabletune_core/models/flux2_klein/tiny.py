"""A tiny FLUX.2 Klein with the real layout and random weights, for tests: built offline, in seconds, from a seed.

Every part is the real class in Klein's arrangement, only narrow: a Flux2Transformer2DModel with two double and two
single blocks, an AutoencoderKLFlux2 with four levels and the latent batch norm (given non-trivial statistics so
the normalisation is exercised), the tiny Qwen3 text encoder and byte-level tokenizer of models/qwen3_text.py
(28 layers, so the pipeline's hidden layers 9, 18, 27 are intermediate ones, as in the real 36-layer encoder) and
the shipped scheduler config. 64 px images are 8 x 8 VAE latents,
4 x 4 = 16 image tokens after the 2 x 2 patchify.

It is written as a diffusers folder (``build_tiny_klein``) and as the files a ComfyUI user keeps
(``build_tiny_klein_single_files``): the transformer in BFL keys under ``models/diffusion_models``, the text encoder
under ``models/text_encoders``, the VAE in the LDM layout under ``models/vae`` and the tokenizer where ComfyUI ships
Qwen's (``comfy/text_encoders/qwen25_tokenizer``: vocab.json, merges.txt, tokenizer_config.json).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..qwen3_text import build_tiny_tokenizer, text_encoder_config
from .family import SHIPPED_CONFIGS

TINY_IMAGE_SIZE = 64

TRANSFORMER_CONFIG = dict(
    patch_size=1,
    in_channels=16,  # 4 latent channels x the 2 x 2 patch
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=48,  # the three stacked text-encoder layers x 16
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=(4, 4, 4, 4),
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=False,
)
VAE_CONFIG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(8, 16, 16, 16),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=8,
    sample_size=TINY_IMAGE_SIZE,
    use_quant_conv=True,
    use_post_quant_conv=True,
    patch_size=(2, 2),
)


def build_tiny_klein_components(seed: int = 0) -> dict:
    """transformer, vae, text_encoder, tokenizer, scheduler of the tiny Klein, in memory, deterministic from seed."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(seed)
    transformer = Flux2Transformer2DModel(**TRANSFORMER_CONFIG)
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLFlux2(**VAE_CONFIG)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():  # latent statistics as a trained VAE has them, not the identity
        vae.bn.running_mean.copy_(0.2 * torch.randn(vae.bn.running_mean.shape, generator=g))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape, generator=g))
    torch.manual_seed(seed + 3)
    text_encoder = Qwen3ForCausalLM(Qwen3Config(**text_encoder_config(tokenizer)))
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(
        str(SHIPPED_CONFIGS["4b"]), subfolder="scheduler", local_files_only=True)
    for m in (transformer, vae, text_encoder):
        m.eval()
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
            "scheduler": scheduler}


def build_tiny_klein(out_dir: Path, seed: int = 0, *, distilled: bool = False) -> Path:
    """Write a complete tiny Klein diffusers folder (``is_distilled`` as asked) and return its path."""
    import diffusers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = build_tiny_klein_components(seed)
    for name in ("transformer", "vae", "text_encoder", "tokenizer", "scheduler"):
        parts[name].save_pretrained(str(out_dir / name))
    index = json.loads((SHIPPED_CONFIGS["4b"] / "model_index.json").read_text())
    index.update(_diffusers_version=diffusers.__version__, is_distilled=distilled)
    (out_dir / "model_index.json").write_text(json.dumps(index, indent=2))
    return out_dir


def build_tiny_klein_single_files(root: Path, seed: int = 0, *, distilled: bool = False) -> dict[str, Path]:
    """The same model as a ComfyUI user keeps it under `root`; returns the paths of the four parts. The transformer
    file is named as BFL names theirs (``flux-2-klein-base-...`` for the base model)."""
    from safetensors.torch import save_file

    from .single_file import transformer_to_bfl, vae_to_ldm

    root = Path(root)
    parts = build_tiny_klein_components(seed)
    paths = {
        "transformer": root / "models" / "diffusion_models" / (
            "flux-2-klein-tiny.safetensors" if distilled else "flux-2-klein-base-tiny.safetensors"),
        "text_encoder": root / "models" / "text_encoders" / "qwen_3_tiny.safetensors",
        "vae": root / "models" / "vae" / "flux2-vae-tiny.safetensors",
        "tokenizer": root / "comfy" / "text_encoders" / "qwen25_tokenizer",
    }
    te_state = {k: v for k, v in parts["text_encoder"].state_dict().items() if k != "lm_head.weight"}  # tied
    states = {"transformer": transformer_to_bfl(parts["transformer"].state_dict()), "text_encoder": te_state,
              "vae": vae_to_ldm(parts["vae"])}
    for name, state in states.items():
        paths[name].parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, str(paths[name]))
    paths["tokenizer"].mkdir(parents=True, exist_ok=True)
    build_tiny_tokenizer(paths["tokenizer"], comfy_layout=True)
    return paths


def write_tiny_config_tree(out_dir: Path, seed: int = 0) -> Path:
    """A config tree (model_index + component configs, no weights) describing the tiny model, the counterpart of
    the shipped ``configs/flux2-klein-4b``, for loading the tiny single files."""
    out_dir = Path(out_dir)
    parts = build_tiny_klein_components(seed)
    for name in ("transformer", "vae", "text_encoder"):
        (out_dir / name).mkdir(parents=True, exist_ok=True)
        parts[name].config.to_json_file(str(out_dir / name / "config.json")) if name == "text_encoder" else \
            parts[name].save_config(str(out_dir / name))
    parts["scheduler"].save_config(str(out_dir / "scheduler"))
    (out_dir / "model_index.json").write_text((SHIPPED_CONFIGS["4b"] / "model_index.json").read_text())
    return out_dir
