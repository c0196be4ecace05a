"""The real FLUX.2 Klein architecture on a GPU (issue 23 item 6): the LoRA training step of the 4B (or 9B)
transformer, built from the shipped config with random weights (nothing downloaded), in bf16 with gradient
checkpointing, at each resolution asked: it/s, peak VRAM, the largest batch that fits, and the memory model's
estimate for the same setting (models/flux2_klein/memory.py) beside the measurement.

The step is StableTune's: the family's flow-matching objective from the shipped scheduler config (noise, sigmas,
velocity target), the transformer called as the family calls it (models/flux2_klein/family.py call_transformer), the
loss of train/forward.py predict_and_loss, LoRA rank 16 on the family's 'attention' preset in fp32 beside the
bf16 base (as lora/inject.py adds it), AdamW, gradient clipping. Text embeddings are random tensors of the real
shape (512 tokens x 3 stacked Qwen3 layers), as with cached text embeddings; the VAE is not on the GPU
(latents cached). What it does not hold: the engine's guards and writers (bench/guard_overhead.py weighs them).

    python bench/klein_gpu.py --device cuda --resolutions 512,1024          # on a GPU machine
    python bench/klein_gpu.py --device cpu --tiny --resolutions 64          # a dry run of the same code path
    python bench/klein_gpu.py ... --write-model DIR   # also write the random model as a Klein diffusers folder

`--write-model` writes the same random transformer with a random Qwen3 text encoder and VAE of the shipped
configs, the tiny tokenizer of models/flux2_klein/tiny.py and the shipped scheduler, so that
bench/transformer_peer.py --model DIR can run StableTune and diffusers' example side by side on the real architecture.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RANK = 16
PRESET = "attention"
SEED = 0


def parse_resolutions(text: str) -> list[int]:
    """'512,1024' -> [512, 1024]; each a positive multiple of 16 (the VAE's 8 x the 2 x 2 patch)."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"--resolutions {text!r} is not a comma-separated list of pixel sizes, e.g. 512,1024.")
    if not sizes or any(s <= 0 or s % 16 for s in sizes):
        raise SystemExit(f"--resolutions {text!r}: each size must be a positive multiple of 16.")
    return sizes


def transformer_config(variant: str, tiny: bool) -> dict:
    from diffusers import Flux2Transformer2DModel

    from stabletune_core.models.flux2_klein.family import SHIPPED_CONFIGS
    from stabletune_core.models.flux2_klein.tiny import TRANSFORMER_CONFIG

    if tiny:
        return dict(TRANSFORMER_CONFIG)
    return dict(Flux2Transformer2DModel.load_config(str(SHIPPED_CONFIGS[variant]), subfolder="transformer"))


def build_transformer(variant: str, tiny: bool, device, dtype):
    """The transformer with random weights, made on `device` (the 4B never passes through host memory in fp32)."""
    import torch
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(SEED)
    with torch.device(device):
        transformer = Flux2Transformer2DModel.from_config(transformer_config(variant, tiny))
    return transformer.to(dtype=dtype).requires_grad_(False)


def store_base(transformer, base_storage: str, device) -> None:
    """The Linear layers stored in `base_storage` (models/quantize.py), before the adapters, as train/setup.py does."""
    import torch

    from stabletune_core.models.quantize import quantise_linear_layers

    if base_storage != "full":
        quantise_linear_layers(transformer, base_storage)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the full-size weights the codes replaced


def store_base_bitsandbytes(transformer, device) -> int:
    """diffusers' Klein example at its 4-bit setting (train_dreambooth_lora_flux2_klein.py with a bitsandbytes
    BitsAndBytesConfig load_in_4bit, nf4, bf16 compute): every Linear layer of the transformer becomes bitsandbytes'
    Linear4bit, quantised as it reaches the GPU, the LoRA on top through peft's bitsandbytes layers. The number of
    layers replaced. Refused in one sentence where bitsandbytes is missing or there is no CUDA device (it quantises
    on the GPU)."""
    import torch

    try:
        import bitsandbytes as bnb
    except ImportError:
        raise SystemExit("--bnb-nf4 needs bitsandbytes, which is not installed for this Python; pip install "
                         "bitsandbytes, or leave --bnb-nf4 out.")
    if device.type != "cuda":
        raise SystemExit("--bnb-nf4 quantises on the GPU (bitsandbytes' Params4bit); run it with --device cuda.")
    replaced = 0
    for parent in list(transformer.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            layer = bnb.nn.Linear4bit(child.in_features, child.out_features, child.bias is not None,
                                      compute_dtype=torch.bfloat16, quant_type="nf4", device="meta")
            layer.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4").to(device)
            if child.bias is not None:
                layer.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
            setattr(parent, name, layer.requires_grad_(False))
            replaced += 1
    torch.cuda.empty_cache()  # the bf16 weights the codes replaced
    return replaced


def swap_blocks(transformer, count: int, device):
    """The last `count` blocks kept in CPU memory (models/block_swap.py), after the adapters (they stay on the
    device); None when `count` is 0."""
    from stabletune_core.models.block_swap import BlockSwap

    blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    return BlockSwap.attach(blocks, count, device) if count else None


def with_lora(transformer, checkpointing: bool):
    """(the transformer with LoRA, its trainable parameters, AdamW, the family's objective)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from stabletune_core.models.flow_matching import FlowMatching
    from stabletune_core.models.flux2_klein.family import LORA_PRESETS, SHIPPED_CONFIGS, call_transformer, lora_target_modules

    params, optimizer = add_lora(transformer, lora_target_modules(transformer, LORA_PRESETS[PRESET]), checkpointing)
    scheduler = FlowMatchEulerDiscreteScheduler.load_config(str(SHIPPED_CONFIGS["4b"]), subfolder="scheduler")
    objective = FlowMatching.from_scheduler(scheduler, call_denoiser=call_transformer)
    return transformer, params, optimizer, objective


def add_lora(model, targets: list[str], checkpointing: bool):
    """(the trainable parameters, AdamW): LoRA rank 16 on `targets`, in fp32 as lora/inject.py keeps adapters beside
    a bf16 base, the model in training mode with gradient checkpointing when asked."""
    import torch
    from peft import LoraConfig

    model.add_adapter(LoraConfig(r=RANK, lora_alpha=RANK, init_lora_weights="gaussian", target_modules=targets))
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    if checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    return params, torch.optim.AdamW(params, lr=1e-4)


def klein_inputs(transformer, device, dtype):
    """(batch, resolution, generator) -> (latents, conditioning): random tensors of the real shapes, as a Klein run
    with cached latents and text embeddings hands the step."""
    import torch
    from diffusers import Flux2KleinPipeline

    from stabletune_core.models.base import Conditioning
    from stabletune_core.models.flux2_klein.family import MAX_SEQUENCE_LENGTH

    config = transformer.config
    latent_channels = config.in_channels  # the family's latents are already patchified (2 x 2 into channels)

    def inputs(batch: int, resolution: int, generator):
        side = resolution // 16  # the VAE's 8 x the 2 x 2 patchify (models/flux2_klein/family.py latent_downscale)
        latents = torch.randn(batch, latent_channels, side, side, generator=generator).to(device, dtype)
        embeds = torch.randn(batch, MAX_SEQUENCE_LENGTH, config.joint_attention_dim, generator=generator
                             ).to(device, dtype)
        return latents, Conditioning(encoder_hidden_states=embeds, added_cond_kwargs={
            "txt_ids": Flux2KleinPipeline._prepare_text_ids(embeds).to(device)})

    return inputs


def make_step(transformer, params, optimizer, objective, device, dtype, inputs=None):
    """One training step at (batch, resolution) on random latents and text embeddings of the real shapes; `inputs`
    makes them ((batch, resolution, generator) -> (latents, conditioning)), Klein's by default (bench/plan_gpu.py
    hands Z-Image's and SDXL's)."""
    import torch

    from stabletune_core.train.forward import predict_and_loss

    inputs = inputs or klein_inputs(transformer, device, dtype)
    generator = torch.Generator().manual_seed(SEED)
    autocast = lambda: torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)  # noqa: E731

    def step(batch: int, resolution: int) -> float:
        latents, cond = inputs(batch, resolution, generator)
        # noise first, then timesteps, as FlowMatching.add_noise draws them; the Objective protocol's two calls, so a
        # DDPM objective steps the same way
        noise = torch.randn(latents.shape, generator=generator).to(latents.device, latents.dtype)
        timesteps = objective.draw_timesteps(latents.shape[0], generator).to(latents.device)
        noisy = objective.noisy_input(latents, noise, timesteps)
        try:
            _, loss = predict_and_loss(objective, transformer, noisy, objective.target(latents, noise, timesteps),
                                       timesteps, cond, dtype=dtype, autocast=autocast, weighted=True)
            loss = loss.mean()
            loss.backward()
        except torch.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)  # what a failed batch left must not weigh on the next
            raise
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def measure(step, device, resolution: int, batch: int, steps: int, max_batch: int, budget_s: float) -> dict:
    """it/s and peak memory at `batch`, then the largest batch by doubling until out of memory, `max_batch` or
    `budget_s` seconds (then the largest batch is a lower bound, marked so)."""
    import torch

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    started = time.perf_counter()
    loss = step(batch, resolution)  # warm-up: kernels chosen, allocator grown
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step(batch, resolution)
    sync()
    seconds = (time.perf_counter() - t0) / steps
    peak_gib = torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else float("nan")
    largest, capped = batch, True
    candidate = batch * 2
    while candidate <= max_batch and time.perf_counter() - started < budget_s:
        try:
            step(candidate, resolution)
            sync()
            largest, candidate = candidate, candidate * 2
        except torch.OutOfMemoryError:
            capped = False
            break
        finally:
            if cuda:
                torch.cuda.empty_cache()
    return {"resolution": resolution, "batch": batch, "sec_per_step": seconds, "it_per_s": 1 / seconds,
            "peak_gib": peak_gib, "largest_batch": largest, "largest_is_lower_bound": capped, "loss": loss}


def write_model(transformer, variant: str, tiny: bool, out: Path) -> Path:
    """The random base model as a Klein diffusers folder (transformer, Qwen3 text encoder, VAE of the shipped configs;
    the tiny tokenizer; the shipped scheduler); refuses a folder that holds files."""
    import diffusers
    import torch
    from diffusers import AutoencoderKLFlux2
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from stabletune_core.models.flux2_klein import tiny as tiny_flux2
    from stabletune_core.models.flux2_klein.family import SHIPPED_CONFIGS

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"--write-model {out} is not empty; give it a new folder (nothing is overwritten).")
    if tiny:
        parts = tiny_flux2.build_tiny_klein_components(SEED)
        text_encoder, vae, tokenizer = parts["text_encoder"], parts["vae"], parts["tokenizer"]
    else:
        folder = SHIPPED_CONFIGS[variant]
        device = next(transformer.parameters()).device
        with torch.device(device):
            text_encoder = Qwen3ForCausalLM(Qwen3Config.from_pretrained(str(folder / "text_encoder")))
            vae = AutoencoderKLFlux2.from_config(AutoencoderKLFlux2.load_config(str(folder), subfolder="vae"))
        text_encoder.to(torch.bfloat16)
        tokenizer = tiny_flux2.build_tiny_tokenizer()  # ids below Qwen's vocabulary: any tokenizer of its family
    transformer.save_pretrained(str(out / "transformer"))
    text_encoder.save_pretrained(str(out / "text_encoder"))
    vae.save_pretrained(str(out / "vae"))
    tokenizer.save_pretrained(str(out / "tokenizer"))
    from diffusers import FlowMatchEulerDiscreteScheduler

    FlowMatchEulerDiscreteScheduler.from_pretrained(str(SHIPPED_CONFIGS["4b"]), subfolder="scheduler",
                                                    local_files_only=True).save_pretrained(str(out / "scheduler"))
    index = json.loads((SHIPPED_CONFIGS["4b"] / "model_index.json").read_text())
    index.update(_diffusers_version=diffusers.__version__, is_distilled=False)
    (out / "model_index.json").write_text(json.dumps(index, indent=2))
    return out


def estimate_gib(variant: str, tiny: bool, batch: int, resolution: int, base_storage: str = "full",
                 blocks_to_swap: int = 0) -> float:
    """The memory model's number for this setting (bf16, checkpointing, text cached, rank 16, this preset)."""
    if tiny:
        return float("nan")
    from stabletune_core.models.flux2_klein.memory import estimate_training_memory

    return estimate_training_memory(variant, precision="bf16", gradient_checkpointing=True, batch_size=batch,
                                    resolution=resolution, lora_rank=RANK, cache_text_embeddings=True,
                                    preset=PRESET, base_storage=base_storage,
                                    blocks_to_swap=blocks_to_swap).total_gib


def markdown(rows: list[dict], title: str) -> str:
    lines = [title, "", "| resolution | batch | it/s | s/step | peak VRAM (GiB, allocated) | memory model (GiB, incl. "
             "VAE + context) | largest batch (doubling) |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        largest = f"≥ {r['largest_batch']}" if r["largest_is_lower_bound"] else str(r["largest_batch"])
        lines.append(f"| {r['resolution']} | {r['batch']} | {r['it_per_s']:.2f} | {r['sec_per_step']:.3f} | "
                     f"{r['peak_gib']:.2f} | {r['estimate_gib']:.1f} | {largest} |")
    return "\n".join(lines)


def device_for(name: str, tiny: bool):
    """The torch device a measurement runs on; one sentence where it cannot (no CUDA, the real size on the CPU)."""
    import torch

    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible here; run with --device cpu --tiny for a dry run.")
    if device.type == "cpu" and not tiny:
        raise SystemExit("The real size on the CPU would take hours per step; add --tiny for a dry run.")
    return device


def report(rows: list[dict], title: str, device, json_path: Path | None) -> None:
    """The rows as a Markdown table under `title` (the device and torch named), and as JSON at `json_path`."""
    import torch

    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(markdown(rows, f"{title}, {where}, torch {torch.__version__}"))
    if json_path:
        json_path.write_text(json.dumps(rows, indent=1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a dry run, with --tiny)")
    parser.add_argument("--variant", choices=("4b", "9b"), default="4b")
    parser.add_argument("--tiny", action="store_true", help="the tiny real-layout Klein instead of the real size")
    parser.add_argument("--resolutions", default="512,1024")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per resolution (after one warm-up)")
    parser.add_argument("--max-batch", type=int, default=16, help="the largest batch tried")
    parser.add_argument("--budget-s", type=float, default=45, help="seconds per resolution for the batch search")
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--write-model", type=Path, default=None, help="also write the model as a diffusers folder")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    parser.add_argument("--base-storage", choices=("full", "int8", "nf4", "fp8"), default="full",
                        help="the frozen weights' storage (the engine's base_storage)")
    parser.add_argument("--blocks-to-swap", type=int, default=0, help="blocks kept in CPU memory (blocks_to_swap)")
    parser.add_argument("--bnb-nf4", action="store_true",
                        help="the base in bitsandbytes' nf4 instead, diffusers' Klein example's 4-bit setting")
    args = parser.parse_args(argv)
    if args.bnb_nf4 and args.base_storage != "full":
        raise SystemExit("--bnb-nf4 stores the base with bitsandbytes; leave --base-storage at full with it.")
    resolutions = parse_resolutions(args.resolutions)

    import torch

    device = device_for(args.device, args.tiny)
    dtype = torch.bfloat16
    transformer = build_transformer(args.variant, args.tiny, device, dtype)
    if args.write_model:  # before the adapters go in: the folder holds the base model
        print(f"model written to {write_model(transformer, args.variant, args.tiny, args.write_model)}")
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the text encoder and VAE written beside it are gone
    if args.bnb_nf4:
        print(f"bitsandbytes nf4: {store_base_bitsandbytes(transformer, device)} Linear layers (the peer's setting)")
    store_base(transformer, args.base_storage, device)
    transformer, params, optimizer, objective = with_lora(transformer, not args.no_checkpointing)
    swap = swap_blocks(transformer, args.blocks_to_swap, device)
    step = make_step(transformer, params, optimizer, objective, device, dtype)
    rows = []
    for resolution in resolutions:
        row = measure(step, device, resolution, args.batch, args.steps, args.max_batch, args.budget_s)
        row["estimate_gib"] = estimate_gib(args.variant, args.tiny, args.batch, resolution, args.base_storage,
                                           args.blocks_to_swap)
        row.update(base_storage="bitsandbytes nf4" if args.bnb_nf4 else args.base_storage,
                   blocks_to_swap=args.blocks_to_swap)
        if args.bnb_nf4:  # our nf4's estimate: the same codes and absmax, a different kernel
            row["estimate_gib"] = estimate_gib(args.variant, args.tiny, args.batch, resolution, "nf4")
        if swap is not None:
            row["blocks_brought_in"] = sum(swap.brought_in.values())
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    name = "tiny Klein" if args.tiny else f"FLUX.2 Klein {args.variant.upper()} (random weights, shipped config)"
    memory = f", base {rows[0]['base_storage']}, {args.blocks_to_swap} blocks swapped"
    report(rows, f"{name}, bf16, gradient checkpointing {'off' if args.no_checkpointing else 'on'}, LoRA rank {RANK} "
                 f"'{PRESET}', AdamW{memory}", device, args.json)


if __name__ == "__main__":
    main()
