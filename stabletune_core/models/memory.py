"""The parts of a training run's memory model that every family shares (each family's own model lives in its folder:
flux2_klein/memory.py, sd/sdxl_memory.py, z_image/memory.py; the plan that asks them is memory_plan.py).

A model, not a measurement. What every family counts the same way:

* weights in a base storage, exact from a config instantiated on the meta device (quantize.storage_bytes), and what
  block swap leaves resident (StoredTransformer);
* the LoRA parameters in fp32 with their gradients and AdamW's two moments: 16 bytes each;
* a transformer's activations kept for the backward pass: about 24 hidden-size vectors per token per block (norms,
  modulation, q, k, v, attention output, the SwiGLU MLP's wide intermediates); with gradient checkpointing only each
  block's input is kept, plus one block recomputed at a time with the gradients flowing through it (28 vectors per
  token). Attention runs through PyTorch SDPA (flash or memory-efficient kernels: no token x token matrix);
* a quantised base's working copy: the layer computing holds its weight dequantised (and its backward another);
* 0.8 GiB for the CUDA context and workspaces, and 5 % for allocator fragmentation, over the training step and over
  the set-up's caching peak alike (MemoryEstimate.setup; `fits` wants both within the card).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

GIB = 1024 ** 3
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
ACTIVATION_VECTORS_PER_BLOCK = 24  # hidden-size vectors per token a block keeps for its backward pass
RECOMPUTE_AND_GRADIENT_VECTORS = 28  # one recomputed block plus the gradients flowing through it
LORA_BYTES_PER_PARAMETER = 4 + 4 + 8  # fp32 weight, gradient, AdamW's two moments
DEQUANTISED_COPIES = 2  # a quantised layer's weight dequantised for the forward, and again for the backward
CONTEXT_BYTES = int(0.8 * GIB)
FRAGMENTATION = 0.05
#: Qwen3-4B's config, the text encoder FLUX.2 Klein 4B and Z-Image both read: shipped once, with Klein 4B's configs
#: (the released Klein 4B and Z-Image folders hold the same text_encoder/config.json).
QWEN3_4B_CONFIG = Path(__file__).resolve().parent / "flux2_klein" / "configs" / "flux2-klein-4b" / "text_encoder"


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int  # frozen denoiser + VAE (+ text encoders when not cached)
    lora: int  # LoRA weights, gradients and optimizer state
    activations: int
    overhead: int  # CUDA context and fragmentation
    setup: int = 0  # the set-up's peak: caching with the VAE and text encoders on the device, the denoiser not yet

    @property
    def total(self) -> int:
        return self.weights + self.lora + self.activations + self.overhead

    @property
    def total_gib(self) -> float:
        return self.total / GIB

    @property
    def peak(self) -> int:
        """The larger of the training step's peak and the set-up's (what the card must hold)."""
        return max(self.total, self.setup)

    def fits(self, gib: float) -> bool:
        return self.peak <= gib * GIB


@dataclass(frozen=True)
class FamilyMemoryModel:
    """What the memory plan (memory_plan.py) asks of a family's memory model: the estimate of a TrainConfig's run with
    its sentence, and how many of the denoiser's blocks the plan may swap (0: none)."""

    sentence: Callable[[Any], tuple[str, MemoryEstimate]]
    swappable_blocks: Callable[[Any], int]


def assemble_estimate(*, weights: int, lora: int, activations: int, caching: int) -> MemoryEstimate:
    """The estimate from its parts, with the context and fragmentation allowance added to the training step and to
    the set-up (`caching`: what the caches need on the device before the denoiser is placed; 0 when nothing is
    cached)."""
    overhead = CONTEXT_BYTES + int(FRAGMENTATION * (weights + lora + activations))
    setup = caching + CONTEXT_BYTES + int(FRAGMENTATION * caching) if caching else 0
    return MemoryEstimate(weights=weights, lora=lora, activations=activations, overhead=overhead, setup=setup)


def run_precision(config: Any) -> str:
    """A TrainConfig's mixed_precision as the memory models name it ("no" trains in fp32)."""
    return {"no": "fp32"}.get(config.mixed_precision, config.mixed_precision)


def precision_bytes(precision: str) -> int:
    """The width of the run's unquantised tensors; a ValueError naming the choices for another precision."""
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision must be one of {', '.join(PRECISION_BYTES)}, not '{precision}'.")
    return PRECISION_BYTES[precision]


def parameter_count(module: Any) -> int:
    """A module's parameters, a tied tensor counted once (torch's parameters() yields it once)."""
    return sum(p.numel() for p in module.parameters())


def largest_linear(model: Any) -> int:
    """Weights of the model's largest Linear layer: what one dequantised layer holds."""
    import torch

    return max(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def dequantised_bytes(storage: str, model_largest_linear: int, width: int) -> int:
    """What a quantised base adds to the step's activations: the layer computing holds its weight dequantised (and
    its backward another copy), plus one chunk's scratch while it dequantises (models/quantize.py dequantise);
    nothing for storage "full"."""
    if storage == "full":
        return 0
    from .quantize import DEQUANTISE_CHUNK, SCRATCH_BYTES

    scratch = min(model_largest_linear, DEQUANTISE_CHUNK) * SCRATCH_BYTES[storage]
    return DEQUANTISED_COPIES * model_largest_linear * width + scratch


def lora_parameter_count(model: Any, targets: Iterable[str], rank: int) -> int:
    """Trainable LoRA parameters at `rank` on the Linear layers whose names end with one of `targets`: rank x (in +
    out) each."""
    import torch

    targets = tuple(targets)
    return sum(rank * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.endswith(targets))


@dataclass(frozen=True)
class StoredTransformer:
    """A transformer's bytes in one storage (exact, from its config on the meta device)."""

    total: int  # every parameter and buffer as stored
    blocks: tuple[int, ...]  # each swappable block's, in the order they run (what block swap moves)
    largest_linear: int  # weights of the largest Linear layer (what one dequantised layer holds)

    def resident(self, swapped: int) -> int:
        """Bytes on the device with the last `swapped` blocks kept in CPU memory: the rest, plus the two largest
        swapped blocks (the one computing and the one being copied in)."""
        if not swapped:
            return self.total
        moved = self.blocks[len(self.blocks) - swapped:]
        return self.total - sum(moved) + sum(sorted(moved)[-2:])


def stored_transformer_of(model: Any, blocks: Sequence[Any], storage: str, dtype_bytes: int) -> StoredTransformer:
    """`model` (on the meta device) in `storage` (base_storage: full, int8, nf4, fp8), the unquantised tensors
    `dtype_bytes` wide; `blocks` its swappable blocks in the order they run."""
    from .quantize import storage_bytes

    return StoredTransformer(total=storage_bytes(model, storage, dtype_bytes),
                             blocks=tuple(storage_bytes(b, storage, dtype_bytes) for b in blocks),
                             largest_linear=largest_linear(model))


@lru_cache(maxsize=None)
def stored_qwen3(folder: Path, storage: str = "full", dtype_bytes: int = 2) -> int:
    """Bytes of the Qwen3 text encoder of `folder`'s config.json in `storage` (quantised with the base when it is not
    cached: train/setup.py), on the meta device (accelerate's init_empty_weights would untie its embeddings)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from .quantize import storage_bytes

    with torch.device("meta"):
        text = Qwen3ForCausalLM(Qwen3Config.from_pretrained(str(folder)))
    return storage_bytes(text, storage, dtype_bytes)


def transformer_activations(block_tokens: Sequence[int], *, hidden: int, width: int, batch_size: int,
                            checkpointing: bool) -> int:
    """What a transformer's training step keeps for its backward: `block_tokens` the tokens each block runs over
    (FLUX.2 Klein: every block all image and text tokens; Z-Image: its refiners one kind each), `hidden` its width,
    `width` the bytes of one activation. See the module docstring."""
    vector = batch_size * hidden * width  # one hidden-size vector per token of the batch
    kept, recomputed = sum(block_tokens), max(block_tokens)
    per_block = 1 if checkpointing else ACTIVATION_VECTORS_PER_BLOCK
    return (kept * per_block + RECOMPUTE_AND_GRADIENT_VECTORS * recomputed) * vector


def estimate_words(model: str, config: Any, estimate: MemoryEstimate, precision: str, text_kept: str) -> str:
    """The estimate's sentence, the same for every family's memory model: the peak and the settings it is for
    (`text_kept`: what stays on the device when text embeddings are not cached)."""
    checkpointing = "gradient checkpointing" if config.gradient_checkpointing else "no gradient checkpointing"
    cached = "text embeddings cached" if config.cache_text_embeddings else text_kept
    memory = "".join([f", base {config.base_storage}" if config.base_storage != "full" else "",
                      f", {config.blocks_to_swap} blocks swapped" if config.blocks_to_swap else ""])
    return (f"Estimated GPU memory for {model}: about {estimate.total_gib:.1f} GiB "
            f"at the training step's peak ({config.resolution} px, batch {config.train_batch_size}, {precision}, "
            f"{checkpointing}, {cached}, rank {config.lora_rank}{memory})"
            + (f"; caching the text embeddings before it needs about {estimate.setup / GIB:.1f} GiB."
               if estimate.setup > estimate.total else "."))
