"""Guard overhead: seconds per optimizer step with every guard on vs. the same loop with guards off.

One process, one session, one model: steps alternate on/off in ABBA order (on, off, off, on, ...) so drift
in machine load hits both sides alike, and the report is the median over pairs of (on / off). "On" is the
full set: adaptive clipping, non-finite check with snapshots and rollback, OOM retry wrapper (RNG capture
each step), weight-norm scaling and the plateau guard. "Off" is the bare loop: forward, backward, gradient
norm, optimizer step. Data loading is outside the timed region (it is the same for both).

    python bench/guard_overhead.py                      # tiny model on drawn shapes (CPU ok)
    python bench/guard_overhead.py --model PATH --data DIR --resolution 512 --batch 4   # a real SD1 on a GPU

Target: median ratio <= 1.03.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="SD1 model (default: the tiny test model, built in a temp dir)")
    parser.add_argument("--data", help="image folder (default: drawn shapes)")
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=20, help="on/off pairs measured (after 2 warm-up steps)")
    parser.add_argument("--rank", type=int, default=4)
    args = parser.parse_args()

    from stabletune_core.config import build_config
    from stabletune_core.demo import draw_demo_dataset
    from stabletune_core.models.sd.tiny import build_tiny_sd1
    from stabletune_core.train.loop import carry_out, setup, training_step
    from stabletune_core.train.session import SessionView
    from stabletune_core.train.step import next_batches

    tmp = Path(tempfile.mkdtemp(prefix="stabletune-bench-"))
    model = args.model or str(build_tiny_sd1(tmp / "model", seed=0))
    data = args.data or str(draw_demo_dataset(tmp / "data", count=16, size=args.resolution, seed=0))
    config = build_config(dict(
        pretrained_model_name_or_path=model, train_data_dir=data, output_dir=str(tmp / "run"),
        resolution=args.resolution, bucket_step=8, min_bucket_reso=min(256, args.resolution // 2),
        max_bucket_reso=max(1024, args.resolution * 2), train_batch_size=args.batch, lora_rank=args.rank,
        lora_alpha=args.rank, learning_rate=1e-4, max_train_steps=10**6, clip_mode="adaptive", clip_window=50,
        nan_guard=True, nan_window=10, oom_guard=True, scale_weight_norms=1.0, lr_scheduler="plateau", seed=0,
        validation_split=0.0))  # every image trains, as in the guard-free variant
    s = setup(config)
    for module in s.trained.values():
        module.train()
    robustness = {"clipping", "memory", "nonfinite", "precision", "weight_norms", "plateau"}
    guards_on = [g for g in s.guards if g.name in robustness]  # diagnostics monitors run on their own cadence
    for guard in guards_on:
        carry_out(s, guard, guard.on_start(SessionView(s)))
    inside = [0.0]  # seconds spent in guard code during "on" steps, measured directly

    def timed(method):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                inside[0] += time.perf_counter() - start
        return wrapper

    for guard in guards_on:
        for hook in ("max_grad_norm", "before_optimizer_step", "after_step", "after_measuring"):
            if hasattr(guard, hook):
                setattr(guard, hook, timed(getattr(guard, hook)))

    variants = {True: dataclasses.replace(s, guards=tuple(guards_on)), False: dataclasses.replace(s, guards=())}

    def step(on: bool) -> float:
        s = variants[on]  # the same model, optimizer and state; only the guards differ
        batches = next_batches(s.feed, s.state, 1)
        s.state.batch_paths = [str(p) for b in batches for p in b["path"]]
        if s.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss, grad_norm, _ = training_step(s, batches)
        s.state.step += 1
        metrics = dict(loss=loss.mean, grad_norm=grad_norm)
        for guard in s.guards:
            carry_out(s, guard, guard.after_step(SessionView(s), metrics))
            carry_out(s, guard, guard.after_measuring(SessionView(s), metrics))
        if s.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    step(True), step(False)  # warm-up
    inside[0] = 0.0
    ratios, on_times, off_times = [], [], []
    for i in range(args.pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        times = {on: step(on) for on in order}
        on_times.append(times[True])
        off_times.append(times[False])
        ratios.append(times[True] / times[False])
    print(f"device {s.device}, resolution {args.resolution}, batch {args.batch}, rank {args.rank}, "
          f"{len(s.params)} LoRA tensors, {args.pairs} pairs")
    print(f"sec/step guards on : median {statistics.median(on_times):.4f}")
    print(f"sec/step guards off: median {statistics.median(off_times):.4f}")
    ratio = statistics.median(ratios)
    direct = 1 + inside[0] / sum(off_times)
    print(f"median ratio on/off (ABBA pairs): {ratio:.4f}  (target <= 1.03: {'ok' if ratio <= 1.03 else 'OVER'})")
    print(f"guard code time per step, measured inside the hooks: {1000 * inside[0] / args.pairs:.2f} ms "
          f"-> ratio {direct:.4f} (robust to machine load; the ABBA ratio is noisy on a shared CPU)")


if __name__ == "__main__":
    main()
