"""Z-Image on the CPU (issue 39.6): the released transformer's weight bytes per base_storage and the memory model's
estimate per plan and per card preset, from the shipped configs on the meta device (no weights; seconds). The model
is stabletune_core/models/z_image/memory.py's; bench/plan_gpu.py measures it on a GPU.

    python bench/z_image_memory.py            # prints the Markdown tables of bench/RESULTS.md
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STORAGES = ("full", "int8", "nf4", "fp8")
#: (resolution, base storage, gradient checkpointing, text cached, blocks swapped)
SETTINGS = [(1024, "full", True, True, 0), (1024, "full", True, False, 0), (1024, "full", False, True, 0),
            (1024, "int8", True, True, 0), (1024, "int8", True, True, 11), (1024, "int8", True, True, 22),
            (1024, "nf4", True, True, 0), (1024, "nf4", True, True, 34), (512, "full", True, True, 0),
            (512, "int8", True, True, 0), (512, "nf4", True, True, 0)]
CARDS = (8, 12, 16, 24)


def gib(n: int) -> str:
    from stabletune_core.models.memory import GIB

    return f"{n / GIB:.2f}"


def bytes_table() -> list[str]:
    from stabletune_core.models.memory import GIB
    from stabletune_core.models.z_image.memory import stored_text_encoder, stored_transformer, vae_parameters

    rows = ["| part | " + " | ".join(STORAGES) + " | largest main layer (full / int8 / nf4) |",
            "|---|" + "---:|" * (len(STORAGES) + 1)]
    stored = {st: stored_transformer(st) for st in STORAGES}
    largest = " / ".join(f"{max(stored[st].blocks) / GIB:.3f}" for st in ("full", "int8", "nf4")) + " GiB"
    rows.append("| Z-Image transformer | " + " | ".join(f"{stored[st].total:,} ({gib(stored[st].total)} GiB)"
                                                        for st in STORAGES) + f" | {largest} |")
    text = {st: stored_text_encoder(st) for st in STORAGES}
    rows.append("| Qwen3-4B (Klein 4B's) | " + " | ".join(f"{text[st]:,} ({gib(text[st])} GiB)" for st in STORAGES)
                + " | - |")
    vae = vae_parameters() * 2
    rows.append(f"| FLUX.1 VAE (bf16) | {vae:,} ({gib(vae)} GiB) | - | - | - | - |")
    return rows


def plan_table() -> list[str]:
    from stabletune_core.models.memory import GIB
    from stabletune_core.models.z_image.memory import estimate_z_image_training_memory

    rows = ["| resolution | base storage | grad. ckpt | text cached | weights on GPU | activations | total | "
            "set-up (caching) | fits " + " / ".join(map(str, CARDS)) + " GiB |", "|---:|---|---|---|---:|---:|---:|---:|---|"]
    for resolution, storage, checkpointing, cached, swapped in SETTINGS:
        e = estimate_z_image_training_memory(resolution=resolution, base_storage=storage,
                                             gradient_checkpointing=checkpointing, cache_text_embeddings=cached,
                                             blocks_to_swap=swapped)
        fits = " / ".join("yes" if e.fits(card) else "no" for card in CARDS)
        storage = f"{storage}, {swapped} blocks swapped" if swapped else storage
        rows.append(f"| {resolution} | {storage} | {'on' if checkpointing else 'off'} | {'yes' if cached else 'no'} | "
                    f"{gib(e.weights)} | {gib(e.activations)} | {e.total / GIB:.1f} | {e.setup / GIB:.1f} | {fits} |")
    return rows


def presets_table() -> list[str]:
    from stabletune_core.config import build_config, read_toml
    from stabletune_core.models.memory_plan import plan_memory

    rows = ["| preset | the plan's line |", "|---|---|"]
    for card in (8, 12, 16, 24):
        values = read_toml(ROOT / "presets" / f"z_image-{card}gb.toml")
        config = build_config({**values, "pretrained_model_name_or_path": "z", "train_data_dir": "d"})
        rows.append(f"| z_image-{card}gb | {plan_memory(config, family='z_image').sentence} |")
    return rows


def main() -> None:
    print("Weight bytes per base_storage (exact: shipped configs on the meta device; unquantised tensors bf16):\n")
    print("\n".join(bytes_table()))
    print("\nEstimated training peak (GiB): bf16, batch 1, rank 16 on every block's attention, captions priced at "
          "max_sequence_length 512:\n")
    print("\n".join(plan_table()))
    print("\nThe card presets (vram_gb, memory knobs left to the plan):\n")
    print("\n".join(presets_table()))


if __name__ == "__main__":
    main()
