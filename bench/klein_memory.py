"""FLUX.2 Klein on the CPU: the real 4B and 9B parameter counts, the denoisers' weight bytes per base_storage (and
SDXL's UNet), and the training-memory model's estimate per setting and per memory plan (issue 36).

The counts come from the shipped config trees instantiated on the meta device (no weights; seconds). The estimate
is stabletune_core/models/flux2_klein/memory.py's model of one training step's peak (what it counts is written there);
the GPU measurement that checks it against torch.cuda.max_memory_allocated is issue 23's later part.

    python bench/klein_memory.py            # prints the counts and a Markdown table
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stabletune_core.models.flux2_klein.memory import (GIB, estimate_training_memory, klein_sizes,  # noqa: E402
                                                 lora_parameters, stored_transformer)

STORAGES = ("full", "int8", "nf4", "fp8")
#: (variant, resolution, base storage, blocks swapped): the plans of issue 36's targets
PLANS = [("4b", 1024, "full", 0), ("4b", 1024, "int8", 0), ("4b", 1024, "nf4", 0), ("4b", 512, "int8", 0),
         ("9b", 1024, "full", 0), ("9b", 1024, "int8", 0), ("9b", 1024, "int8", 10), ("9b", 1024, "nf4", 0),
         ("9b", 1024, "nf4", 16), ("9b", 1024, "nf4", 24), ("9b", 512, "int8", 10)]

SETTINGS = [  # (variant, precision, checkpointing, batch, resolution, rank, cache text)
    ("4b", "bf16", True, 1, 1024, 16, True),
    ("4b", "bf16", True, 1, 1024, 16, False),
    ("4b", "bf16", False, 1, 1024, 16, True),
    ("4b", "bf16", True, 1, 512, 16, True),
    ("4b", "bf16", True, 2, 1024, 16, True),
    ("4b", "bf16", True, 4, 512, 64, True),
    ("4b", "fp32", True, 1, 1024, 16, True),
    ("9b", "bf16", True, 1, 1024, 16, True),
    ("9b", "bf16", True, 1, 1024, 16, False),
    ("9b", "bf16", False, 1, 1024, 16, True),
    ("9b", "bf16", True, 1, 512, 16, True),
    ("9b", "bf16", True, 2, 1024, 64, True),
    ("9b", "fp32", True, 1, 1024, 16, True),
]


def main() -> None:
    print("Parameters (exact, shipped configs on the meta device):\n")
    print("| variant | transformer | text encoder (Qwen3) | VAE | all three | LoRA r16 'attention' | LoRA r16 "
          "'attention_mlp' | LoRA r16 'diffusers_default' (the example's targets) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for variant in ("4b", "9b"):
        s = klein_sizes(variant)
        lora = [lora_parameters(variant, 16, preset) for preset in ("attention", "attention_mlp", "diffusers_default")]
        print(f"| {variant.upper()} | {s.transformer:,} | {s.text_encoder:,} | {s.vae:,} | "
              f"{s.transformer + s.text_encoder + s.vae:,} | " + " | ".join(f"{n:,}" for n in lora) + " |")
    print("\nWeight bytes of the denoiser per base_storage (exact: shipped configs on the meta device; unquantised "
          "tensors bf16):\n")
    print("| model | " + " | ".join(STORAGES) + " | largest block (full / int8 / nf4) |")
    print("|---|" + "---:|" * (len(STORAGES) + 1))
    for variant in ("4b", "9b"):
        stored = {st: stored_transformer(variant, st) for st in STORAGES}
        cells = [f"{stored[st].total:,} ({stored[st].total / GIB:.2f} GiB)" for st in STORAGES]
        print(f"| Klein {variant.upper()} transformer | " + " | ".join(cells)
              + " | " + " / ".join(f"{max(stored[st].blocks) / GIB:.3f}" for st in ("full", "int8", "nf4")) + " GiB |")
    unet = sdxl_unet_bytes()
    print("| SDXL UNet | " + " | ".join(f"{unet[st]:,} ({unet[st] / GIB:.2f} GiB)" for st in STORAGES) + " | - |")
    print("\nEstimated training peak per plan (GiB): bf16, gradient checkpointing, text cached, batch 1, rank 16:\n")
    print("| variant | resolution | base storage | blocks swapped | weights on GPU | activations | total "
          "| set-up (caching, Qwen3 in the base's storage) | fits 8 / 12 / 16 GiB |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---|")
    for variant, res, storage, swapped in PLANS:
        e = estimate_training_memory(variant, precision="bf16", gradient_checkpointing=True, resolution=res,
                                     base_storage=storage, blocks_to_swap=swapped)
        fits = " / ".join("yes" if e.fits(g) else "no" for g in (8, 12, 16))
        print(f"| {variant.upper()} | {res} | {storage} | {swapped} | {e.weights / GIB:.2f} | "
              f"{e.activations / GIB:.2f} | {e.total_gib:.1f} | {e.setup / GIB:.1f} | {fits} |")
    sdxl_table()
    print("\nEstimated training peak (GiB), LoRA preset 'attention', AdamW:\n")
    print("| variant | precision | grad. ckpt | batch | resolution | rank | text cached | weights | LoRA+optim "
          "| activations | overhead | total | fits 12 / 16 / 24 GiB |")
    print("|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|")
    for variant, precision, ckpt, batch, res, rank, cached in SETTINGS:
        e = estimate_training_memory(variant, precision=precision, gradient_checkpointing=ckpt, batch_size=batch,
                                     resolution=res, lora_rank=rank, cache_text_embeddings=cached)
        fits = " / ".join("yes" if e.fits(g) else "no" for g in (12, 16, 24))
        print(f"| {variant.upper()} | {precision} | {'on' if ckpt else 'off'} | {batch} | {res} | {rank} | "
              f"{'yes' if cached else 'no'} | {e.weights / GIB:.2f} | {e.lora / GIB:.2f} | {e.activations / GIB:.2f} "
              f"| {e.overhead / GIB:.2f} | {e.total_gib:.1f} | {fits} |")


def sdxl_table() -> None:
    """SDXL's estimate per plan (models/sd/sdxl_memory.py: activations from the real UNet's forward on fake tensors)."""
    from stabletune_core.models.sd.sdxl_memory import estimate_sdxl_training_memory

    print("\nSDXL estimated training peak (GiB): bf16, text cached, batch 1, rank 16, SD attention targets:\n")
    print("| resolution | base storage | grad. ckpt | weights on GPU | activations | total | set-up (caching) "
          "| fits 6 / 8 / 12 GiB |")
    print("|---:|---|---|---:|---:|---:|---:|---|")
    for res, storage, ckpt in ((1024, "full", False), (1024, "full", True), (1024, "int8", False),
                               (1024, "int8", True), (1024, "nf4", True), (768, "int8", True), (512, "full", True)):
        e = estimate_sdxl_training_memory(resolution=res, base_storage=storage, gradient_checkpointing=ckpt)
        fits = " / ".join("yes" if e.fits(g) else "no" for g in (6, 8, 12))
        print(f"| {res} | {storage} | {'on' if ckpt else 'off'} | {e.weights / GIB:.2f} | {e.activations / GIB:.2f} "
              f"| {e.total_gib:.1f} | {e.setup / GIB:.1f} | {fits} |")


def sdxl_unet_bytes() -> dict[str, int]:
    """SDXL's UNet (the shipped sdxl_base config on the meta device) per base_storage, in bytes."""
    import torch
    from diffusers import UNet2DConditionModel

    from stabletune_core.models.quantize import storage_bytes

    folder = Path(__file__).resolve().parent.parent / "stabletune_core" / "models" / "sd" / "configs" / "sdxl_base"
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(str(folder), subfolder="unet"))
    return {storage: storage_bytes(unet, storage) for storage in STORAGES}


if __name__ == "__main__":
    main()
