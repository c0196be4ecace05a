"""The memory plans of Z-Image and SDXL measured on their real sizes (issue 39.6, issue 36.5): the denoiser built from
the shipped config with random weights on the device (nothing downloaded), stored as the plan for a card chooses
(`--plan-gb N`: models/memory_plan.py, as a run with vram_gb N would plan it, at the largest resolution asked), LoRA
rank 16 on the family's attention targets, gradient checkpointing, a training step at each resolution: it/s,
torch.cuda.max_memory_allocated and the memory model's estimate for the same setting beside it.

The step is bench/klein_gpu.py's (StableTune's objective and loss through train/forward.py, AdamW, clipping), only
the inputs are the family's: Z-Image's 16-channel latents with a caption of max_sequence_length tokens (the length the
estimate prices) through models/z_image/family.py call_transformer and the flow-matching objective of its scheduler;
SDXL's 4-channel latents, two CLIP encoders' 77 x 2048 states, pooled embeddings and time ids, on its DDPM schedule.
Text and latents are random tensors of the real shapes, as with both caches on; the VAE is not on the device.

    python bench/plan_gpu.py --family z_image --plan-gb 12 --resolutions 512,1024   # on a GPU machine
    python bench/plan_gpu.py --family sdxl --plan-gb 6 --resolutions 1024
    python bench/plan_gpu.py --family z_image --device cpu --tiny --resolutions 64  # a dry run of the same code path
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from klein_gpu import (RANK, SEED, add_lora, device_for, make_step, measure, parse_resolutions,  # noqa: E402
                       report, store_base)

FAMILIES = ("z_image", "sdxl")


def planned_storage(family: str, card_gib: float, resolution: int) -> tuple[str, str]:
    """(base_storage, the plan's sentence) of a run of `family` at `resolution` planned for `card_gib` GiB, the
    memory knobs left to the plan as the card presets leave them."""
    from stabletune_core.config import build_config
    from stabletune_core.models.memory_plan import plan_memory

    config = build_config(dict(model_family=family, pretrained_model_name_or_path="planned", train_data_dir="data",
                               resolution=resolution, mixed_precision="bf16", lora_rank=RANK, vram_gb=card_gib))
    plan = plan_memory(config, family=family)
    return plan.update.get("base_storage", config.base_storage), plan.sentence


def build_denoiser(family: str, tiny: bool, device, dtype):
    """The denoiser with random weights, made on `device` (the real size never passes through host memory)."""
    import torch
    from diffusers import UNet2DConditionModel, ZImageTransformer2DModel

    torch.manual_seed(SEED)
    if family == "z_image":
        from stabletune_core.models.z_image.memory import Z_IMAGE_CONFIGS
        from stabletune_core.models.z_image.tiny import TRANSFORMER_CONFIG

        config = dict(TRANSFORMER_CONFIG) if tiny else ZImageTransformer2DModel.load_config(
            str(Z_IMAGE_CONFIGS), subfolder="transformer")
        with torch.device(device):
            model = ZImageTransformer2DModel.from_config(config)
    else:
        from stabletune_core.models.sd.sdxl_memory import SDXL_CONFIGS
        from stabletune_core.models.sd.tiny import SDXL_UNET_CONFIG

        config = dict(SDXL_UNET_CONFIG) if tiny else UNet2DConditionModel.load_config(str(SDXL_CONFIGS),
                                                                                        subfolder="unet")
        with torch.device(device):
            model = UNet2DConditionModel.from_config(config)
    return model.to(dtype=dtype).requires_grad_(False)


def with_lora(family: str, model, checkpointing: bool):
    """(the denoiser with LoRA on the family's attention targets, its trainable parameters, AdamW, the objective)."""
    if family == "z_image":
        from stabletune_core.models.flow_matching import FlowMatching
        from stabletune_core.models.z_image.family import call_transformer
        from stabletune_core.models.z_image.memory import ATTENTION_TARGETS as targets
        from stabletune_core.models.z_image.tiny import SCHEDULER_CONFIG

        objective = FlowMatching.from_scheduler(SCHEDULER_CONFIG, call_denoiser=call_transformer)
    else:
        from diffusers import DDPMScheduler

        from stabletune_core.models.ddpm import DDPMObjective
        from stabletune_core.models.sd.sdxl_memory import SD_TARGETS as targets, SDXL_CONFIGS

        objective = DDPMObjective(DDPMScheduler.from_pretrained(str(SDXL_CONFIGS), subfolder="scheduler",
                                                                local_files_only=True))
    params, optimizer = add_lora(model, list(targets), checkpointing)
    return model, params, optimizer, objective


def family_inputs(family: str, model, device, dtype):
    """(batch, resolution, generator) -> (latents, conditioning) of the real shapes, both caches on."""
    import torch

    from stabletune_core.models.base import Conditioning
    from stabletune_core.models.qwen3_text import MAX_SEQUENCE_LENGTH

    config = model.config
    randn = lambda *shape, generator: torch.randn(*shape, generator=generator).to(device, dtype)  # noqa: E731

    def z_image(batch: int, resolution: int, generator):
        latents = randn(batch, config.in_channels, resolution // 8, resolution // 8, generator=generator)
        captions = randn(batch, MAX_SEQUENCE_LENGTH, config.cap_feat_dim, generator=generator)
        mask = torch.ones(batch, MAX_SEQUENCE_LENGTH, dtype=torch.long, device=device)
        return latents, Conditioning(encoder_hidden_states=captions, added_cond_kwargs={"attention_mask": mask})

    def sdxl(batch: int, resolution: int, generator):
        latents = randn(batch, config.in_channels, resolution // 8, resolution // 8, generator=generator)
        states = randn(batch, 77, config.cross_attention_dim, generator=generator)
        pooled = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        return latents, Conditioning(encoder_hidden_states=states, added_cond_kwargs={
            "text_embeds": randn(batch, pooled, generator=generator),
            "time_ids": torch.tensor([[resolution, resolution, 0, 0, resolution, resolution]] * batch,
                                     device=device, dtype=dtype)})

    return z_image if family == "z_image" else sdxl


def estimate_gib(family: str, tiny: bool, batch: int, resolution: int, base_storage: str) -> float:
    """The memory model's number for this setting (bf16, checkpointing, text cached, rank 16, attention)."""
    if tiny:
        return float("nan")
    if family == "z_image":
        from stabletune_core.models.z_image.memory import estimate_z_image_training_memory as estimate
    else:
        from stabletune_core.models.sd.sdxl_memory import estimate_sdxl_training_memory as estimate
    return estimate(precision="bf16", gradient_checkpointing=True, batch_size=batch, resolution=resolution,
                    lora_rank=RANK, cache_text_embeddings=True, base_storage=base_storage).total_gib


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=FAMILIES, required=True)
    parser.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a dry run, with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="the tiny real-layout model instead of the real size")
    parser.add_argument("--plan-gb", type=float, default=None,
                        help="store the base as the memory plan for a card of this many GiB chooses")
    parser.add_argument("--base-storage", choices=("full", "int8", "nf4", "fp8"), default=None,
                        help="the frozen weights' storage, instead of the plan's")
    parser.add_argument("--resolutions", default="512,1024")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per resolution (after one warm-up)")
    parser.add_argument("--max-batch", type=int, default=1, help="the largest batch tried (1: no batch search)")
    parser.add_argument("--budget-s", type=float, default=20, help="seconds per resolution for the batch search")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    resolutions = parse_resolutions(args.resolutions)
    if (args.plan_gb is None) == (args.base_storage is None):
        raise SystemExit("Give either --plan-gb (the base stored as the plan for that card chooses) or "
                         "--base-storage, not both or neither.")
    storage, sentence = (args.base_storage, "") if args.base_storage else planned_storage(
        args.family, args.plan_gb, max(resolutions))

    import torch

    device = device_for(args.device, args.tiny)
    if sentence:
        print(sentence)
    dtype = torch.bfloat16
    model = build_denoiser(args.family, args.tiny, device, dtype)
    store_base(model, storage, device)
    model, params, optimizer, objective = with_lora(args.family, model, checkpointing=True)
    step = make_step(model, params, optimizer, objective, device, dtype,
                     inputs=family_inputs(args.family, model, device, dtype))
    rows = []
    for resolution in resolutions:
        row = measure(step, device, resolution, args.batch, args.steps, args.max_batch, args.budget_s)
        row.update(family=args.family, base_storage=storage, plan_gb=args.plan_gb,
                   estimate_gib=estimate_gib(args.family, args.tiny, args.batch, resolution, storage))
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    name = {"z_image": "Z-Image", "sdxl": "SDXL"}[args.family]
    name = f"tiny {name}" if args.tiny else f"{name} (random weights, shipped config)"
    plan = f", the {args.plan_gb:g} GB plan" if args.plan_gb else ""
    report(rows, f"{name}, bf16, gradient checkpointing, LoRA rank {RANK} attention, AdamW, base {storage}{plan}",
           device, args.json)


if __name__ == "__main__":
    main()
