"""How much accelerator memory a Z-Image LoRA run needs at the training step's peak (issue 39.6: presets for 12, 16
and 24 GB, the memory plan, the UI's estimate before Start).

Counted as every family's (models/memory.py says what and how), from the shipped configs on the meta device:
the released transformer (configs/z-image: Tongyi-MAI's transformer/config.json, the same for Base and Turbo;
6.15 B parameters), FLUX.1's 16-channel AutoencoderKL, and Qwen3-4B (FLUX.2 Klein 4B's text encoder, whose config is
shipped once: models/memory.py QWEN3_4B_CONFIG). Every Z-Image fine-tune has these sizes, so a model is priced from
them whatever its files (`folder`: another size's configs, as bench/cpu_peak.py prices the tiny Z-Image).

Activations per block as for FLUX.2 Klein, over the tokens each block runs on: Z-Image refines the image tokens
(side / 16 squared) in its two noise refiners and the caption in its two context refiners, each alone, and then runs
its 30 main layers over both. A caption is cut to its own tokens (not padded to max_sequence_length, only to a
multiple of 32), so the estimate, which runs before any caption is read, prices the longest one the run can read:
max_sequence_length tokens.

Block swap (blocks_to_swap, models/block_swap.py) moves the blocks family.py swappable_blocks names, in run order:
the 2 noise refiners, the 2 context refiners and the 30 main layers, the last N kept in CPU memory (so the main
layers go first). Each block's bytes per storage are exact (stored_transformer: 362 MB in bf16, 181 MB in int8, a
context refiner a little less: no adaLN modulation); the device holds the rest plus the two largest swapped blocks
(the one computing and the one being copied in), as for Klein. tests/test_block_swap.py shows a tiny Z-Image run
with every block swapped bitwise the run without, so the plan may swap them: at 1024 px it fits 12 GB with int8
and none swapped, 8 GB with int8 and 11 swapped (presets/z_image-8gb.toml), 6 GB with int8 and 22.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from ..memory import (LORA_BYTES_PER_PARAMETER, QWEN3_4B_CONFIG, FamilyMemoryModel, MemoryEstimate, StoredTransformer,
                      assemble_estimate, dequantised_bytes, estimate_words, lora_parameter_count, parameter_count,
                      precision_bytes, run_precision, stored_qwen3, stored_transformer_of, transformer_activations)
from ..qwen3_text import MAX_SEQUENCE_LENGTH

Z_IMAGE_CONFIGS = Path(__file__).resolve().parent / "configs" / "z-image"
ATTENTION_TARGETS = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0")
PATCH_PIXELS = 16  # the VAE's 8 x, then the transformer's 2 x 2 patches


@lru_cache(maxsize=None)
def _meta_transformer(folder: Path = Z_IMAGE_CONFIGS):
    import torch
    from diffusers import ZImageTransformer2DModel

    with torch.device("meta"):
        return ZImageTransformer2DModel.from_config(ZImageTransformer2DModel.load_config(str(folder),
                                                                                         subfolder="transformer"))


@lru_cache(maxsize=None)
def vae_parameters(folder: Path = Z_IMAGE_CONFIGS) -> int:
    import torch
    from diffusers import AutoencoderKL

    with torch.device("meta"):
        return parameter_count(AutoencoderKL.from_config(AutoencoderKL.load_config(str(folder), subfolder="vae")))


@lru_cache(maxsize=None)
def stored_transformer(storage: str = "full", dtype_bytes: int = 2, folder: Path = Z_IMAGE_CONFIGS
                       ) -> StoredTransformer:
    """The transformer in `storage` (base_storage: full, int8, nf4, fp8), the unquantised tensors `dtype_bytes` wide;
    its blocks are the ones block swap moves, in run order (family.py swappable_blocks: refiners, then main layers)."""
    from .family import swappable_blocks

    model = _meta_transformer(folder)
    return stored_transformer_of(model, swappable_blocks(model), storage, dtype_bytes)


def text_encoder_config(folder: Path = Z_IMAGE_CONFIGS) -> Path:
    """The Qwen3 config a Z-Image is priced with: its folder's own text_encoder/ (a tiny Z-Image), else Qwen3-4B."""
    own = folder / "text_encoder"
    return own if (own / "config.json").is_file() else QWEN3_4B_CONFIG


def stored_text_encoder(storage: str = "full", dtype_bytes: int = 2, folder: Path = Z_IMAGE_CONFIGS) -> int:
    """Qwen3-4B's bytes in `storage` (quantised with the base when it is not cached: train/setup.py)."""
    return stored_qwen3(text_encoder_config(folder), storage, dtype_bytes)


@lru_cache(maxsize=None)
def lora_parameters(rank: int, targets: tuple[str, ...] = ATTENTION_TARGETS, folder: Path = Z_IMAGE_CONFIGS) -> int:
    """Trainable LoRA parameters at `rank` on the Linear layers the targets name (family.py LORA_PRESETS: every
    block's attention, the refiners' included)."""
    return lora_parameter_count(_meta_transformer(folder), targets, rank)


def block_tokens(resolution: int | tuple[int, int], text_tokens: int, folder: Path = Z_IMAGE_CONFIGS) -> list[int]:
    """The tokens each block runs over, in order: the noise refiners the image's, the context refiners the
    caption's, the main layers both (each padded to a multiple of 32, as the transformer pads them)."""
    h, w = (resolution, resolution) if isinstance(resolution, int) else resolution
    pad = lambda n: -(-n // 32) * 32  # noqa: E731 (transformer_z_image.py SEQ_MULTI_OF)
    image, text = pad((h // PATCH_PIXELS) * (w // PATCH_PIXELS)), pad(text_tokens)
    model = _meta_transformer(folder)
    return ([image] * len(model.noise_refiner) + [text] * len(model.context_refiner)
            + [image + text] * len(model.layers))


def estimate_z_image_training_memory(*, precision: str = "bf16", gradient_checkpointing: bool = True,
                                     batch_size: int = 1, resolution: int | tuple[int, int] = 1024,
                                     lora_rank: int = 16, cache_text_embeddings: bool = True,
                                     base_storage: str = "full", targets: tuple[str, ...] = ATTENTION_TARGETS,
                                     text_tokens: int = MAX_SEQUENCE_LENGTH, blocks_to_swap: int = 0,
                                     folder: Path = Z_IMAGE_CONFIGS) -> MemoryEstimate:
    """The peak memory of one Z-Image LoRA training step (and of the caching before it; see the module docstring)."""
    width = precision_bytes(precision)
    stored = stored_transformer(base_storage, width, folder)
    activations = transformer_activations(block_tokens(resolution, text_tokens, folder),
                                          hidden=_meta_transformer(folder).config.dim, width=width,
                                          batch_size=batch_size, checkpointing=gradient_checkpointing)
    activations += dequantised_bytes(base_storage, stored.largest_linear, width)
    vae = vae_parameters(folder) * width
    encoder = stored_text_encoder(base_storage, width, folder)  # quantised with the base, cached or not (setup.py)
    weights = stored.resident(blocks_to_swap) + vae + (0 if cache_text_embeddings else encoder)
    lora = lora_parameters(lora_rank, targets, folder) * LORA_BYTES_PER_PARAMETER
    caching = encoder + vae if cache_text_embeddings else 0  # the transformer is placed after the caches
    return assemble_estimate(weights=weights, lora=lora, activations=activations, caching=caching)


def z_image_memory_sentence(config: Any, folder: Path = Z_IMAGE_CONFIGS) -> tuple[str, MemoryEstimate]:
    """The estimate for a TrainConfig's Z-Image run, and its sentence (the SD default LoRA targets stand for Z-Image's
    own, as the run resolves them)."""
    from ...config.families import family_defaults

    config = config.model_copy(update=family_defaults(config, "z_image"))
    precision = run_precision(config)
    estimate = estimate_z_image_training_memory(
        precision=precision, gradient_checkpointing=config.gradient_checkpointing, batch_size=config.train_batch_size,
        resolution=config.resolution, lora_rank=config.lora_rank, cache_text_embeddings=config.cache_text_embeddings,
        base_storage=config.base_storage, targets=tuple(config.unet_lora_targets),
        text_tokens=config.max_sequence_length, blocks_to_swap=config.blocks_to_swap, folder=folder)
    model = "Z-Image" if folder == Z_IMAGE_CONFIGS else f"Z-Image of {folder.name}'s configs"
    return estimate_words(model, config, estimate, precision, "Qwen3 kept loaded"), estimate


#: What the memory plan asks of Z-Image: the released sizes' estimate (every Z-Image has them), and every block of
#: theirs may be swapped (34: the 4 refiners and the 30 main layers).
MEMORY_MODEL = FamilyMemoryModel(sentence=z_image_memory_sentence,
                                 swappable_blocks=lambda config: len(stored_transformer().blocks))
