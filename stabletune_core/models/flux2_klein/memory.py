"""How much accelerator memory a FLUX.2 Klein LoRA run needs, estimated before any model loads (for the UI's
number before Start and the presets' "4B at 12 GB, 9B at 24 GB").

A model, not a measurement, counted as every family's (models/memory.py says what is counted and how): parameter
counts are exact (the shipped configs instantiated on the meta device); activations are counted per token and per
block from the transformer's layout, over image tokens (side / 16 squared) plus the text tokens (max_sequence_length,
512 by default), every block over all of them. The frozen transformer is counted in its storage precision and the
VAE (kept for encoding and validation images); the Qwen3 text encoder only when text embeddings are not cached
(cached, it runs once before training and is released).

The set-up's peak is counted beside it (`MemoryEstimate.setup`; `fits` wants both within the card): text embeddings
are cached with Qwen3 (in the base's storage) and the VAE on the device, before the transformer is placed there.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..memory import (GIB, LORA_BYTES_PER_PARAMETER, FamilyMemoryModel, MemoryEstimate,  # noqa: F401 (GIB: callers)
                      StoredTransformer, assemble_estimate, dequantised_bytes, estimate_words, parameter_count,
                      precision_bytes, run_precision, stored_qwen3, stored_transformer_of, transformer_activations)
from .family import LORA_PRESETS, MAX_SEQUENCE_LENGTH, SHIPPED_CONFIGS, lora_target_modules


@dataclass(frozen=True)
class KleinSizes:
    transformer: int
    text_encoder: int
    vae: int
    hidden: int
    blocks: int


def config_folder(model: str | Path) -> Path:
    """The config folder a Klein model is priced from: a shipped variant's ("4b" / "9b"), or any Klein diffusers
    folder's own (transformer/, vae/, text_encoder/ configs: the tiny Klein of tiny_flux2.py, a fine-tune)."""
    return SHIPPED_CONFIGS[model] if model in SHIPPED_CONFIGS else Path(model)


@lru_cache(maxsize=None)
def klein_sizes(variant: str | Path) -> KleinSizes:
    """Exact parameter counts of a shipped variant ("4b" / "9b") or a Klein folder, from its configs on the meta
    device."""
    import torch
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = config_folder(variant)
    with torch.device("meta"):  # (accelerate's init_empty_weights would untie Qwen3-4B's embeddings)
        transformer = Flux2Transformer2DModel.from_config(Flux2Transformer2DModel.load_config(str(folder),
                                                                                               subfolder="transformer"))
        vae = AutoencoderKLFlux2.from_config(AutoencoderKLFlux2.load_config(str(folder), subfolder="vae"))
        text = Qwen3ForCausalLM(Qwen3Config.from_pretrained(str(folder / "text_encoder")))
    config = transformer.config
    return KleinSizes(transformer=parameter_count(transformer), text_encoder=parameter_count(text),
                      vae=parameter_count(vae),
                      hidden=config.num_attention_heads * config.attention_head_dim,
                      blocks=config.num_layers + config.num_single_layers)


def _meta_transformer(variant: str | Path):
    import torch
    from diffusers import Flux2Transformer2DModel

    with torch.device("meta"):
        return Flux2Transformer2DModel.from_config(Flux2Transformer2DModel.load_config(
            str(config_folder(variant)), subfolder="transformer"))


@lru_cache(maxsize=None)
def stored_transformer(variant: str | Path, storage: str = "full", dtype_bytes: int = 2) -> StoredTransformer:
    """The transformer of a shipped variant ("4b" / "9b") or a Klein folder in `storage` (base_storage: full, int8, nf4, fp8), the
    unquantised tensors `dtype_bytes` wide."""
    model = _meta_transformer(variant)
    return stored_transformer_of(model, [*model.transformer_blocks, *model.single_transformer_blocks], storage,
                                 dtype_bytes)


@lru_cache(maxsize=None)
def stored_text_encoder(variant: str | Path, storage: str = "full", dtype_bytes: int = 2) -> int:
    """Bytes of a shipped variant's (or a Klein folder's) Qwen3 text encoder in `storage` (quantised when it is not
    cached: setup.py)."""
    return stored_qwen3(config_folder(variant) / "text_encoder", storage, dtype_bytes)


@lru_cache(maxsize=None)
def lora_parameters(variant: str | Path, rank: int, preset: str | tuple[str, ...] = "attention") -> int:
    """Trainable LoRA parameters of a preset (or a tuple of targets) at `rank`: rank x (in + out) per adapted
    Linear layer."""
    import torch

    transformer = _meta_transformer(variant)
    modules = dict(transformer.named_modules())
    total = 0
    targets = LORA_PRESETS[preset] if isinstance(preset, str) else list(preset)
    for name in lora_target_modules(transformer, targets):
        layer: torch.nn.Linear = modules[name]
        total += rank * (layer.in_features + layer.out_features)
    return total


def estimate_training_memory(variant: str | Path = "4b", *, precision: str = "bf16", gradient_checkpointing: bool = True,
                             batch_size: int = 1, resolution: int | tuple[int, int] = 1024, lora_rank: int = 16,
                             cache_text_embeddings: bool = True,
                             preset: str | tuple[str, ...] = "attention",
                             text_tokens: int = MAX_SEQUENCE_LENGTH, base_storage: str = "full",
                             blocks_to_swap: int = 0) -> MemoryEstimate:
    """The peak memory of one training step of a Klein LoRA (see the module docstring for what is counted); `variant`
    a shipped size ("4b" / "9b") or a Klein diffusers folder, priced from its own configs."""
    width = precision_bytes(precision)
    sizes = klein_sizes(variant)
    stored = stored_transformer(variant, base_storage, width)
    h, w = (resolution, resolution) if isinstance(resolution, int) else resolution
    tokens = (h // 16) * (w // 16) + text_tokens  # every block, double and single, runs over image and text tokens
    activations = transformer_activations([tokens] * sizes.blocks, hidden=sizes.hidden, width=width,
                                          batch_size=batch_size, checkpointing=gradient_checkpointing)
    activations += dequantised_bytes(base_storage, stored.largest_linear, width)
    encoder = stored_text_encoder(variant, base_storage, width)  # quantised with the base, cached or not (setup.py)
    text = 0 if cache_text_embeddings else encoder
    weights = stored.resident(blocks_to_swap) + sizes.vae * width + text
    lora = lora_parameters(variant, lora_rank, preset) * LORA_BYTES_PER_PARAMETER
    # caching runs before the transformer is placed (setup.py): Qwen3 and the VAE, a batch's activations are small
    caching = encoder + sizes.vae * width if cache_text_embeddings else 0
    return assemble_estimate(weights=weights, lora=lora, activations=activations, caching=caching)


def variant_of(source: str | Path) -> str | None:
    """"4b" or "9b" for a released Klein's diffusers folder or BFL transformer file, read from its config or header
    (no weights); None when it cannot be told (not there yet, another width)."""
    from ..sources import safetensors_header
    from .family import RELEASED_WIDTHS
    from .single_file import bfl_shape_facts

    path = Path(str(source)).expanduser()
    try:
        if path.is_dir():
            config = json.loads((path / "transformer" / "config.json").read_text())
            width = config["num_attention_heads"] * config["attention_head_dim"]
        elif path.is_file():
            width = bfl_shape_facts(safetensors_header(path)[0])["hidden_size"]
        else:
            return None
    except (OSError, ValueError, KeyError):
        return None
    return dict(zip(RELEASED_WIDTHS, ("4b", "9b"))).get(width)


class UnknownSize(ValueError):
    """The model is not a released Klein whose size could be read: there is no number to give."""


def config_memory_sentence(config: Any, *, unknown_as: str | None = None,
                           from_configs: bool = False) -> tuple[str, MemoryEstimate]:
    """The estimate for a TrainConfig's run of FLUX.2 Klein, and the sentence the UI shows before Start (the
    SD default LoRA targets stand for Klein's own, as the run resolves them). A model whose size cannot be read
    has no number (UnknownSize), unless `unknown_as` ("4b" or "9b") names the size to plan it as: the memory plan
    of a run must choose something, and its sentence then says the size was assumed. `from_configs`: a diffusers
    folder of another size is priced from its own configs (bench/cpu_peak.py prices the tiny Klein so)."""
    from ...config.families import family_defaults

    config = config.model_copy(update=family_defaults(config, "flux2_klein"))
    variant = variant_of(config.pretrained_model_name_or_path)
    folder = Path(str(config.pretrained_model_name_or_path))
    if variant is None and from_configs and (folder / "transformer" / "config.json").is_file():
        precision, estimate = _config_estimate(config, folder)
        return estimate_words(f"FLUX.2 Klein of {folder.name}'s configs", config, estimate, precision,
                              "Qwen3 kept loaded"), estimate
    if variant is None and unknown_as is None:  # a 4B guess showed 17.8 GiB for the toy Klein (issue 37.7)
        raise UnknownSize(f"No GPU-memory estimate: {Path(str(config.pretrained_model_name_or_path)).name or 'the model'} "
                          "is not a released FLUX.2 Klein 4B or 9B that could be read (the estimate covers those two).")
    assumed = "" if variant else " (assumed: the model's size is not a released one or could not be read)"
    variant = variant or unknown_as
    precision, estimate = _config_estimate(config, variant)
    return estimate_words(f"FLUX.2 Klein {variant.upper()}{assumed}", config, estimate, precision,
                          "Qwen3 kept loaded"), estimate


def _config_estimate(config: Any, variant: str | Path) -> tuple[str, MemoryEstimate]:
    """(the precision, the estimate) of a TrainConfig's run of `variant` (a shipped size or a Klein folder)."""
    precision = run_precision(config)
    return precision, estimate_training_memory(
        variant, precision=precision, gradient_checkpointing=config.gradient_checkpointing,
        batch_size=config.train_batch_size, resolution=config.resolution, lora_rank=config.lora_rank,
        cache_text_embeddings=config.cache_text_embeddings, preset=tuple(config.unet_lora_targets),
        text_tokens=config.max_sequence_length, base_storage=config.base_storage,
        blocks_to_swap=config.blocks_to_swap)


def _blocks(config: Any) -> int:
    return klein_sizes(variant_of(config.pretrained_model_name_or_path) or "4b").blocks


#: What the memory plan asks of Klein: a plan must choose, so a size that cannot be read is planned as a 4B (and its
#: sentence says so); every double and single block may be swapped.
MEMORY_MODEL = FamilyMemoryModel(sentence=lambda config: config_memory_sentence(config, unknown_as="4b"),
                                 swappable_blocks=_blocks)
