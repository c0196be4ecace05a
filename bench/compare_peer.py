"""StableTune against a bare peft training loop: same model, same data, same LoRA, same batch.

CPU mode (default) times, each in its own process so peak RSS is that variant's own:

  (a) peer   a bare diffusers-style loop (what train_text_to_image_lora.py does, minus the CLI): load the
             images, VAE-encode, CLIP-encode, add noise, UNet with a peft LoRA, MSE, backward, clip, AdamW
  (b) guards StableTune's real `train()` with guards and monitoring on (non-finite guard, OOM guard,
             gradient clipping, a metrics line and a status.json heartbeat every step, control polling)
  (c) cached (b) plus the latent and text-embedding caches

Variants run in rotated rounds (abc, bca, cab, ...) so drifting machine load hits them alike; the report
is the median over rounds of each variant's median step time. Targets: (b) <= 1.03 x (a), (c) <= 0.75 x (a).

With --side_by_side, (a) runs in the same process as (b) and (c), one peer step between each two StableTune
steps of the real `train()`, and the report is the median of the per-pair ratios: on a shared, busy CPU this
is far steadier than separate processes (their load differs by tens of percent from one minute to the next).

    python bench/compare_peer.py                 # tiny model on drawn shapes, CPU
    python bench/compare_peer.py --side_by_side --threads 1   # the same, steps interleaved in one process
    python bench/compare_peer.py --gpu           # SD1.5-sized random weights at 512 px (needs CUDA)

GPU mode builds SD1.5's architecture from the shipped config with random weights and, for fp32 without
gradient checkpointing and for bf16 (fp16 where bf16 is missing) with gradient checkpointing, reports
it/s of the LoRA training step, peak VRAM, and the largest batch that fits at 512 px (doubling, then
bisecting, until CUDA runs out of memory). Target: mixed precision + GC peak VRAM <= 0.5 x fp32 no-GC.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

RANK, ALPHA, LR, SEED = 4, 4.0, 1e-4, 0
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def peak_rss_mb() -> float:
    """This process's peak resident memory. VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork+exec,
    so every child would report at least the parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux; an upper bound


# --------------------------------------------------------------------------------------------- (a) peer
class PeerLoop:
    """The bare loop, one step per call."""

    def __init__(self, model: str, data: str, resolution: int, batch: int) -> None:
        import torch
        from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
        from peft import LoraConfig
        from torchvision import transforms
        from transformers import CLIPTextModel, CLIPTokenizer

        torch.manual_seed(SEED)
        self.tokenizer = CLIPTokenizer.from_pretrained(model, subfolder="tokenizer")
        self.text_encoder = CLIPTextModel.from_pretrained(model, subfolder="text_encoder")
        self.vae = AutoencoderKL.from_pretrained(model, subfolder="vae")
        self.unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet")
        self.scheduler = DDPMScheduler.from_pretrained(model, subfolder="scheduler")
        for m in (self.unet, self.vae, self.text_encoder):
            m.requires_grad_(False)
        self.unet.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, init_lora_weights="gaussian",
                                         target_modules=TARGETS))
        self.params = [p for p in self.unet.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=LR)
        self.unet.train()
        self.images = sorted(p for p in Path(data).iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg", ".webp"))
        self.captions = [p.with_suffix(".txt").read_text().strip() if p.with_suffix(".txt").exists() else ""
                         for p in self.images]
        self.tf = transforms.Compose([transforms.Resize(resolution), transforms.CenterCrop(resolution),
                                      transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])
        self.batch = batch
        self.count = 0

    def step(self) -> float:
        """One training step; returns its duration in seconds."""
        import torch
        import torch.nn.functional as F
        from PIL import Image

        start = time.perf_counter()
        rows = [(self.count * self.batch + i) % len(self.images) for i in range(self.batch)]
        self.count += 1
        pixels = torch.stack([self.tf(Image.open(self.images[i]).convert("RGB")) for i in rows])
        ids = self.tokenizer([self.captions[i] for i in rows], padding="max_length",
                             max_length=self.tokenizer.model_max_length, truncation=True, return_tensors="pt").input_ids
        with torch.no_grad():
            latents = self.vae.encode(pixels).latent_dist.sample() * self.vae.config.scaling_factor
            hidden = self.text_encoder(ids, return_dict=False)[0]
        noise = torch.randn_like(latents)
        t = torch.randint(0, self.scheduler.config.num_train_timesteps, (self.batch,))
        pred = self.unet(self.scheduler.add_noise(latents, noise, t), t, hidden, return_dict=False)[0]
        loss = F.mse_loss(pred.float(), noise.float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss.item()  # the peer logs its loss every step too
        return time.perf_counter() - start


def run_peer(model: str, data: str, resolution: int, batch: int, steps: int) -> list[float]:
    """The bare loop. Returns one duration per step."""
    peer = PeerLoop(model, data, resolution, batch)
    return [peer.step() for _ in range(steps)]


# ------------------------------------------------------------------------------------------ (b), (c) ours
def stabletune_config(model: str, data: str, resolution: int, batch: int, steps: int, cached: bool, out: Path):
    from stabletune_core.config import build_config

    return build_config(dict(
        pretrained_model_name_or_path=model, train_data_dir=data, output_dir=str(out), resolution=resolution,
        bucket_step=8, min_bucket_reso=min(256, resolution // 2), max_bucket_reso=max(1024, resolution * 2),
        train_batch_size=batch, lora_rank=RANK, lora_alpha=ALPHA, learning_rate=LR, max_train_steps=steps,
        seed=SEED, save_steps=10**6, logging_steps=1, nan_guard=True, oom_guard=True, clip_mode="fixed",
        max_grad_norm=1.0, cache_latents=cached, cache_text_embeddings=cached, save_precision="fp32",
        validation_split=0.0))  # the same images as the peer: none held out


def run_stabletune(model: str, data: str, resolution: int, batch: int, steps: int, cached: bool,
                   out: Path) -> list[float]:
    from stabletune_core.train.loop import train

    train(stabletune_config(model, data, resolution, batch, steps, cached, out))
    stamps = [json.loads(line)["time"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [b - a for a, b in zip(stamps, stamps[1:])]


def run_side_by_side(peer: PeerLoop, model: str, data: str, resolution: int, batch: int, steps: int, cached: bool,
                     out: Path) -> tuple[list[float], list[float]]:
    """StableTune's real `train()`, with one peer step run between each two of its steps, in this process.

    The peer step runs where the loop polls for UI commands (obey_control); StableTune's step i is the time
    from the end of that poll to the end of the next one, less the peer step inside it. Alternating step by
    step puts both under the same machine load, which a shared CPU changes from one second to the next.
    Returns (StableTune step times, peer step times), pair by pair.
    """
    from stabletune_core.train import loop

    poll = loop.obey_control
    ours, theirs, mark = [], [], [None]

    def obey_control_then_peer_step(s):
        start = time.perf_counter()
        answer = poll(s)
        polled = time.perf_counter() - start
        if mark[0] is not None:
            ours.append(start - mark[0] + polled)
            theirs.append(peer.step())
        mark[0] = time.perf_counter()
        return answer

    loop.obey_control = obey_control_then_peer_step
    try:
        loop.train(stabletune_config(model, data, resolution, batch, steps, cached, out))
    finally:
        loop.obey_control = poll
    return ours, theirs


def side_by_side_report(args: argparse.Namespace, model: str, data: str) -> None:
    import torch

    torch.set_num_threads(args.threads)
    peer = PeerLoop(model, data, args.resolution, args.batch)
    for _ in range(args.warmup):
        peer.step()
    pairs: dict[str, list[tuple[float, float]]] = {"b": [], "c": []}
    for r in range(args.rounds):
        for variant in ("bc" if r % 2 == 0 else "cb"):
            out = Path(tempfile.mkdtemp(prefix=f"bench-{variant}-")) / "run"
            ours, theirs = run_side_by_side(peer, model, data, args.resolution, args.batch, args.steps,
                                            variant == "c", out)
            pairs[variant] += list(zip(ours, theirs))[args.warmup:]
            ratio = statistics.median(a / b for a, b in pairs[variant])
            print(f"round {r + 1}: ({variant}) / (a) so far: {ratio:.3f}", file=sys.stderr)
    print(f"\nSide by side in one process (one peer step between each two StableTune steps): tiny SD1 at "
          f"{args.resolution}px, batch {args.batch}, {args.steps} steps x {args.rounds} rounds per variant, "
          f"{args.threads} thread(s)")
    print(f"{'variant':40s} {'pairs':>6s} {'ours s/step':>12s} {'peer s/step':>12s} {'median ratio':>13s}")
    names = {"b": "(b) StableTune, guards + monitoring", "c": "(c) StableTune + caches"}
    targets = {"b": 1.03, "c": 0.75}
    for v in "bc":
        ratio = statistics.median(a / b for a, b in pairs[v])
        print(f"{names[v]:40s} {len(pairs[v]):6d} {statistics.median(a for a, _ in pairs[v]):12.4f} "
              f"{statistics.median(b for _, b in pairs[v]):12.4f} {ratio:13.3f}  "
              f"({'meets' if ratio <= targets[v] else 'MISSES'} <= {targets[v]})")


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    args.variant = args.child
    if args.variant == "a":
        times = run_peer(args.model, args.data, args.resolution, args.batch, args.steps)
    else:
        out = Path(tempfile.mkdtemp(prefix=f"bench-{args.variant}-")) / "run"
        times = run_stabletune(args.model, args.data, args.resolution, args.batch, args.steps, args.variant == "c",
                               out)
    warm = times[args.warmup:]
    print(json.dumps({"variant": args.variant, "median_s": statistics.median(warm), "mean_s": statistics.mean(warm),
                      "steps": len(warm), "peak_rss_mb": peak_rss_mb()}))


def cpu_report(args: argparse.Namespace) -> None:
    from stabletune_core.demo import draw_demo_dataset
    from stabletune_core.models.sd.tiny import build_tiny_sd1

    tmp = Path(tempfile.mkdtemp(prefix="stabletune-peer-"))
    model = args.model or str(build_tiny_sd1(tmp / "model", seed=0))
    data = args.data or str(draw_demo_dataset(tmp / "data", count=16, size=args.resolution, seed=0))
    if args.side_by_side:
        side_by_side_report(args, model, data)
        return
    names = {"a": "(a) bare peft loop", "b": "(b) StableTune, guards + monitoring", "c": "(c) StableTune + caches"}
    results: dict[str, list[dict]] = {v: [] for v in "abc"}
    order = "abc"
    for r in range(args.rounds):
        for variant in order[r % 3:] + order[: r % 3]:
            cmd = [sys.executable, __file__, "--child", variant, "--model", model, "--data", data,
                   "--resolution", str(args.resolution), "--batch", str(args.batch), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--threads", str(args.threads)]
            env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if done.returncode:
                sys.exit(f"variant {variant} failed:\n{done.stderr[-3000:]}")
            results[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}: {names[variant]}: {results[variant][-1]['median_s'] * 1000:.1f} ms/step",
                  file=sys.stderr)
    sec = {v: statistics.median(x["median_s"] for x in results[v]) for v in "abc"}
    rss = {v: max(x["peak_rss_mb"] for x in results[v]) for v in "abc"}
    print(f"\nTiny SD1 at {args.resolution}px, batch {args.batch}, LoRA rank {RANK}, {args.steps} steps "
          f"({args.warmup} warm-up) x {args.rounds} rounds, {args.threads} threads")
    print(f"{'variant':40s} {'s/step':>8s} {'vs (a)':>7s} {'peak RSS MB':>12s}")
    for v in "abc":
        print(f"{names[v]:40s} {sec[v]:8.4f} {sec[v] / sec['a']:7.3f} {rss[v]:12.0f}")
    verdict = "meets" if sec["b"] <= 1.03 * sec["a"] else "MISSES"
    print(f"(b)/(a) = {sec['b'] / sec['a']:.3f}: {verdict} the <= 1.03 target")


# ------------------------------------------------------------------------------------------------ GPU mode
def gpu_report(args: argparse.Namespace) -> None:
    import torch

    if not torch.cuda.is_available():
        sys.exit("--gpu needs CUDA; no CUDA device is visible here (the CPU comparison is the default mode).")
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig

    from stabletune_core.models.sd.sd1 import SD15_CONFIG_DIR

    device = torch.device("cuda")
    mixed = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    side = args.resolution // 8

    def build(dtype: torch.dtype, checkpointing: bool):
        torch.manual_seed(SEED)
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(SD15_CONFIG_DIR / "unet"))
        unet.requires_grad_(False)
        unet.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights="gaussian", target_modules=TARGETS))
        unet.to(device, dtype=dtype)
        for p in unet.parameters():
            if p.requires_grad:
                p.data = p.data.float()  # adapters train in fp32, as StableTune does
        if checkpointing:
            unet.enable_gradient_checkpointing()
        unet.train()
        params = [p for p in unet.parameters() if p.requires_grad]
        return unet, params, torch.optim.AdamW(params, lr=LR)

    def step(unet, params, opt, dtype, batch: int) -> None:
        latents = torch.randn(batch, 4, side, side, device=device, dtype=dtype)
        hidden = torch.randn(batch, 77, 768, device=device, dtype=dtype)
        t = torch.randint(0, 1000, (batch,), device=device)
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            pred = unet(latents, t, hidden, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred.float(), latents.float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def fits(unet, params, opt, dtype, batch: int) -> bool:
        try:
            step(unet, params, opt, dtype, batch)
            torch.cuda.synchronize()
            return True
        except torch.OutOfMemoryError:
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            return False

    rows = []
    for label, dtype, gc in [("fp32, no GC", torch.float32, False), (f"{str(mixed)[6:]} + GC", mixed, True)]:
        unet, params, opt = build(dtype, gc)
        for _ in range(2):
            step(unet, params, opt, dtype, args.batch)  # warm-up (cuDNN autotune, allocator)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(args.steps):
            step(unet, params, opt, dtype, args.batch)
        torch.cuda.synchronize()
        its = args.steps / (time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() / 2**30
        lo, hi = args.batch, args.batch  # largest batch that fits: double, then bisect
        while hi <= args.max_batch and fits(unet, params, opt, dtype, hi):
            lo, hi = hi, hi * 2
        hi = min(hi, args.max_batch + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(unet, params, opt, dtype, mid) else (lo, mid)
        rows.append((label, its, peak, lo))
        del unet, params, opt
        torch.cuda.empty_cache()
    print(f"\nSD1.5-sized UNet (random weights from the shipped config), LoRA rank 16, {args.resolution}px, "
          f"batch {args.batch}, {torch.cuda.get_device_name()}")
    print(f"{'setting':16s} {'it/s':>7s} {'peak VRAM GiB':>14s} {'max batch':>10s}")
    for label, its, peak, biggest in rows:
        print(f"{label:16s} {its:7.2f} {peak:14.2f} {biggest:10d}")
    ratio = rows[1][2] / rows[0][2]
    print(f"mixed+GC / fp32 peak VRAM = {ratio:.2f}: {'meets' if ratio <= 0.5 else 'MISSES'} the <= 0.5 target")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="SD1.5-sized GPU report instead of the CPU comparison")
    parser.add_argument("--model", help="SD1 diffusers folder (CPU mode; default: the tiny test model)")
    parser.add_argument("--data", help="image folder (CPU mode; default: drawn shapes)")
    parser.add_argument("--resolution", type=int, default=None, help="default 64 on CPU, 512 with --gpu")
    parser.add_argument("--batch", type=int, default=None, help="default 4 on CPU, 1 with --gpu")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 40 CPU, 20 GPU)")
    parser.add_argument("--warmup", type=int, default=5, help="CPU: steps left out of each run's median")
    parser.add_argument("--rounds", type=int, default=3, help="CPU: rotated rounds of (a), (b), (c)")
    parser.add_argument("--threads", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    parser.add_argument("--max_batch", type=int, default=256, help="GPU: stop the largest-batch search here")
    parser.add_argument("--side_by_side", action="store_true",
                        help="CPU: one process, peer and StableTune steps alternating (see run_side_by_side)")
    parser.add_argument("--child", choices=["a", "b", "c"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.resolution = args.resolution or (512 if args.gpu else 64)
    args.batch = args.batch or (1 if args.gpu else 4)
    args.steps = args.steps or (20 if args.gpu else 40)
    if args.child:
        child(args)
    elif args.gpu:
        gpu_report(args)
    else:
        cpu_report(args)


if __name__ == "__main__":
    main()
