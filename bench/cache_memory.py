"""Start-up and training VRAM with latent + text caches, before and after issue 14 item 7 (needs CUDA).

  before  the VAE and text encoder stay on the GPU for the whole run, and the validation-loss set and the
          activation probe are built before step 1 (what StableTune did)
  after   the cached-away VAE and text encoder wait on the CPU (they come back only to sample), and the
          validation set and probe are built when first measured (here: never within the timed steps)

Each variant runs in its own process on SD1.5's architecture with random weights (the shipped configs) at
512 px, bf16 (fp16 without bf16), latents and text embeddings cached, and reports: seconds from setup to the
end of step 1, VRAM allocated once training starts, and peak VRAM over the training steps.

    python bench/cache_memory.py [--steps 5] [--model DIR]      # on a CPU machine it says it needs CUDA
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 2**30


def build_sd15_random(folder: Path) -> Path:
    """SD1.5's architecture with random weights, as a diffusers folder (saved in fp16 to halve the writing)."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from stabletune_core.models.sd.sd1 import SD15_CONFIG_DIR

    if (folder / "model_index.json").exists():
        return folder
    torch.manual_seed(0)
    shutil.copytree(SD15_CONFIG_DIR / "tokenizer", folder / "tokenizer")
    shutil.copytree(SD15_CONFIG_DIR / "scheduler", folder / "scheduler")
    UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(SD15_CONFIG_DIR / "unet")).to(
        torch.float16).save_pretrained(folder / "unet")
    AutoencoderKL.from_config(AutoencoderKL.load_config(SD15_CONFIG_DIR / "vae")).to(
        torch.float16).save_pretrained(folder / "vae")
    CLIPTextModel(CLIPTextConfig.from_pretrained(SD15_CONFIG_DIR / "text_encoder")).to(
        torch.float16).save_pretrained(folder / "text_encoder")
    shutil.copy(SD15_CONFIG_DIR / "model_index.json", folder / "model_index.json")
    return folder


def child(variant: str, model: str, data: str, steps: int, out: Path) -> None:
    import torch

    from stabletune_core.config import build_config
    from stabletune_core.train import loop, setup, step

    mixed = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    config = build_config(dict(
        pretrained_model_name_or_path=model, train_data_dir=data, output_dir=str(out), resolution=512,
        train_batch_size=1, max_train_steps=steps, mixed_precision=mixed, gradient_checkpointing=True,
        cache_latents=True, cache_text_embeddings=True, validation_loss_every=100, activation_stats_every=200,
        diagnostics_every=0, save_steps=10**6, lora_rank=16, lora_alpha=16, seed=0))
    if variant == "before":
        setup.frozen_modules_to_offload = lambda *a, **k: {}  # keep them on the GPU, as before
    start = time.perf_counter()
    s = setup.setup(config)
    if variant == "before":  # built before step 1, as before
        observers = {o.name: o for o in s.observers}
        observers["validation_loss"].fixed_set()
        observers["activations"].probe_set()
    for module in s.trained.values():
        module.train()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    first_step = None
    for _ in range(steps):
        loop.training_step(s, step.next_batches(s.feed, s.state, 1))
        s.state.step += 1
        torch.cuda.synchronize()
        first_step = first_step or time.perf_counter() - start
    print(json.dumps({"variant": variant, "to_first_step_s": first_step, "allocated_gib": allocated / GIB,
                      "peak_gib": torch.cuda.max_memory_allocated() / GIB, "precision": mixed}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an SD1 diffusers folder (default: SD1.5 architecture, random weights)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--child", choices=["before", "after"], help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("cache_memory: needs CUDA (peak VRAM with the VAE and text encoder on or off the GPU); skipped.")
        return
    if args.child:
        child(args.child, args.model, args.data, args.steps, Path(tempfile.mkdtemp(prefix="cache-mem-")) / "run")
        return
    from stabletune_core.demo import draw_demo_dataset

    tmp = Path(tempfile.mkdtemp(prefix="cache-memory-"))
    model = args.model or str(build_sd15_random(tmp / "sd15-random"))
    data = str(draw_demo_dataset(tmp / "data", count=8, size=512, seed=0))
    rows = {}
    for variant in ("before", "after"):
        cmd = [sys.executable, __file__, "--child", variant, "--model", model, "--data", data, "--steps",
               str(args.steps)]
        done = subprocess.run(cmd, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
                                   "STABLETUNE_CACHE": str(tmp / "cache")})
        if done.returncode:
            sys.exit(f"variant {variant} failed:\n{done.stderr[-3000:]}")
        rows[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\nSD1.5 architecture (random weights), 512 px, batch 1, {rows['after']['precision']} + gradient "
          f"checkpointing, latents + text cached, {args.steps} steps, {torch.cuda.get_device_name()}")
    print(f"{'variant':8s} {'to step 1 s':>12s} {'VRAM at start GiB':>18s} {'peak VRAM GiB':>14s}")
    for variant, row in rows.items():
        print(f"{variant:8s} {row['to_first_step_s']:12.2f} {row['allocated_gib']:18.2f} {row['peak_gib']:14.2f}")
    saved = rows["before"]["peak_gib"] - rows["after"]["peak_gib"]
    print(f"peak VRAM after / before = {rows['after']['peak_gib'] / rows['before']['peak_gib']:.2f} "
          f"({saved:.2f} GiB freed for training)")


if __name__ == "__main__":
    main()
