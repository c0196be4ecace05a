"""How much accelerator memory an SDXL LoRA run needs at the training step's peak (issue 36: SDXL within 6 GB).

Weights are exact (the shipped sdxl_base configs on the meta device, in each base_storage). Activations are not a
per-token rule of thumb as for the transformers (models/memory.py): a UNet's tensors change shape at every level, so they
are counted by running the real UNet's forward on fake tensors (torch's FakeTensorMode: shapes, no memory, no
arithmetic) and adding up every tensor autograd saves for the backward pass, with and without gradient checkpointing;
with it, the largest checkpointed unit's own saved tensors are added once more (a resnet or transformer of a block,
recomputed during the backward). The rest is counted as every family's (models/memory.py: LoRA and optimizer
state, a quantised layer's working copy, the CUDA context and fragmentation).

No block swap for the UNet, so the memory plan (memory_plan.py) never swaps SDXL blocks: Klein's swap
(block_swap.py) moves blocks of one size that run one after the other, each once per forward, with one hidden state
passing between them, so "bring in the next, send back the last" is the whole schedule and the run stays bitwise.
SDXL's UNet has eight blocks of very different sizes (the mid block and the first up block hold about two thirds of
the weights, the first down block almost none), and every down block's outputs are kept for the up path's skip
connections: swapping whole blocks frees little unless the two large ones go, and those are the ones computing most
of the time; swapping their ten-layer transformers one by one is a hook per transformer layer that nobody has tested
bitwise here yet. By this model SDXL at 1024 px fits 6 GiB without it (int8, gradient checkpointing, text cached).
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from ..memory import (LORA_BYTES_PER_PARAMETER, FamilyMemoryModel, MemoryEstimate, assemble_estimate,
                      dequantised_bytes, estimate_words, largest_linear, lora_parameter_count, parameter_count,
                      precision_bytes, run_precision)

SDXL_CONFIGS = Path(__file__).resolve().parent / "configs" / "sdxl_base"
SD_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


#: Every function below prices the shipped SDXL base 1.0 unless given another SDXL diffusers folder (`folder`: its
#: unet/, vae/, text_encoder/, text_encoder_2/ configs; the tiny SDXL of tiny.py), read the same way.


@lru_cache(maxsize=None)
def _meta_unet(folder: Path = SDXL_CONFIGS):
    import torch
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        return UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(str(folder), subfolder="unet"))


@lru_cache(maxsize=None)
def stored_unet(storage: str = "full", dtype_bytes: int = 2, folder: Path = SDXL_CONFIGS) -> int:
    """SDXL's UNet bytes in `storage` (base_storage), the unquantised tensors `dtype_bytes` wide."""
    from ..quantize import storage_bytes

    return storage_bytes(_meta_unet(folder), storage, dtype_bytes)


@lru_cache(maxsize=None)
def frozen_part_parameters(folder: Path = SDXL_CONFIGS) -> tuple[int, int]:
    """(VAE, both text encoders) parameters of the SDXL configs (meta device)."""
    import torch
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    with torch.device("meta"):
        vae = AutoencoderKL.from_config(AutoencoderKL.load_config(str(folder), subfolder="vae"))
        one = CLIPTextModel(CLIPTextConfig.from_pretrained(str(folder / "text_encoder")))
        two = CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(str(folder / "text_encoder_2")))
    return parameter_count(vae), parameter_count(one) + parameter_count(two)


@lru_cache(maxsize=None)
def _largest_linear(folder: Path = SDXL_CONFIGS) -> int:
    return largest_linear(_meta_unet(folder))


@lru_cache(maxsize=None)
def lora_parameters(rank: int, targets: tuple[str, ...] = SD_TARGETS, folder: Path = SDXL_CONFIGS) -> int:
    return lora_parameter_count(_meta_unet(folder), targets, rank)


@lru_cache(maxsize=None)
def _fake_step(resolution: int, batch_size: int, checkpointing: bool, dtype_bytes: int,
               folder: Path = SDXL_CONFIGS) -> tuple[int, tuple[int, ...]]:
    """(all bytes autograd saves for the backward, those saved inside each checkpointed unit) of one forward of the
    real UNet on fake tensors, only the to_q weights needing a gradient (what an adapted network saves)."""
    import torch
    from diffusers import UNet2DConditionModel
    from torch._subclasses.fake_tensor import FakeTensorMode

    previous = torch.get_default_dtype()
    torch.set_default_dtype({2: torch.bfloat16, 4: torch.float32}[dtype_bytes])  # built fake in the run's dtype
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(str(folder), subfolder="unet"))
            unet.requires_grad_(False)
            for name, module in unet.named_modules():
                if name.endswith("to_q"):
                    module.weight.requires_grad_(True)
            # diffusers checkpoints each resnet and each transformer of a block: those are the recomputed units
            blocks = [unit for block in (*unet.down_blocks, unet.mid_block, *unet.up_blocks)
                      for unit in (*getattr(block, "resnets", ()), *(getattr(block, "attentions", None) or ()))]
            per_block, current, total = [0] * len(blocks), [-1], [0]
            for i, block in enumerate(blocks):
                block.register_forward_pre_hook(lambda _m, _a, i=i: current.__setitem__(0, i))

            weights = {id(p) for p in unet.parameters()}  # saved for the input's gradient, but already counted

            def pack(tensor: torch.Tensor) -> torch.Tensor:
                if id(tensor) in weights or id(tensor._base) in weights:
                    return tensor
                size = tensor.numel() * tensor.element_size()
                total[0] += size
                if current[0] >= 0:
                    per_block[current[0]] += size
                return tensor

            if checkpointing:
                unet.enable_gradient_checkpointing()
                unet.train()
            side, config = resolution // 8, unet.config
            pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim  # 1280
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                unet(torch.randn(batch_size, config.in_channels, side, side), torch.tensor([500] * batch_size),
                     encoder_hidden_states=torch.randn(batch_size, 77, config.cross_attention_dim),
                     added_cond_kwargs={"text_embeds": torch.randn(batch_size, pooled),
                                        "time_ids": torch.randn(batch_size, 6)})
    finally:
        torch.set_default_dtype(previous)
    return total[0], tuple(per_block)


def saved_activation_bytes(resolution: int, batch_size: int, checkpointing: bool, dtype_bytes: int = 2,
                           folder: Path = SDXL_CONFIGS) -> int:
    """What one training step keeps for its backward; with checkpointing plus the largest checkpointed unit's own
    saved tensors once more (a resnet or transformer of a block, recomputed during the backward)."""
    total, _ = _fake_step(resolution, batch_size, checkpointing, dtype_bytes, folder)
    if not checkpointing:
        return total
    return total + max(_fake_step(resolution, batch_size, False, dtype_bytes, folder)[1])


def estimate_sdxl_training_memory(*, precision: str = "bf16", gradient_checkpointing: bool = True,
                                  batch_size: int = 1, resolution: int = 1024, lora_rank: int = 16,
                                  cache_text_embeddings: bool = True, base_storage: str = "full",
                                  targets: tuple[str, ...] = SD_TARGETS,
                                  folder: Path = SDXL_CONFIGS) -> MemoryEstimate:
    """The peak memory of one SDXL LoRA training step (and of the caching before it; see the module docstring)."""
    width = precision_bytes(precision)
    vae, text = frozen_part_parameters(folder)
    vae_bytes = vae * (4 if precision == "fp16" else width)  # under fp16 the VAE stays fp32 (placement.py)
    encoders = 0 if cache_text_embeddings else text * width
    weights = stored_unet(base_storage, width, folder) + vae_bytes + encoders
    activations = saved_activation_bytes(resolution, batch_size, gradient_checkpointing, width, folder)
    activations += dequantised_bytes(base_storage, _largest_linear(folder), width)
    lora = lora_parameters(lora_rank, targets, folder) * LORA_BYTES_PER_PARAMETER
    caching = text * width + vae_bytes if cache_text_embeddings else 0  # the UNet is placed after the caches
    return assemble_estimate(weights=weights, lora=lora, activations=activations, caching=caching)


def sdxl_memory_sentence(config: Any, folder: Path = SDXL_CONFIGS) -> tuple[str, MemoryEstimate]:
    """The estimate for a TrainConfig's SDXL run, and its sentence (in every family's words: models/memory.py estimate_words).
    The sizes are SDXL base 1.0's (the shipped configs) whatever the checkpoint: every SDXL fine-tune has them
    (`folder`: another size's configs, as bench/cpu_peak.py prices the tiny SDXL)."""
    precision = run_precision(config)
    estimate = estimate_sdxl_training_memory(
        precision=precision, gradient_checkpointing=config.gradient_checkpointing, batch_size=config.train_batch_size,
        resolution=config.resolution, lora_rank=config.lora_rank, cache_text_embeddings=config.cache_text_embeddings,
        base_storage=config.base_storage, targets=tuple(config.unet_lora_targets), folder=folder)
    return estimate_words("SDXL", config, estimate, precision, "both CLIP text encoders kept loaded"), estimate


#: What the memory plan asks of SDXL: the shipped sizes' estimate, and no UNet block swap (the module docstring says
#: why).
MEMORY_MODEL = FamilyMemoryModel(sentence=sdxl_memory_sentence, swappable_blocks=lambda config: 0)
