"""CPU threads: seconds per training step at 1 thread vs. every core, for a small and a large UNet, side by side.

What train/threads.py decides for a CPU run rests on this: a small UNet (the tiny test model, the toy base) is
dispatch-bound, so one thread is as fast or faster than all cores; a large one is compute-bound, so it gains from
the cores that are idle. One process per model; steps alternate between the thread counts in ABBA order (1, N, N,
1, ...) so drift in the machine's load hits both alike, and the report is the median over pairs of
(N threads / 1 thread). The machine's load average is printed before and after: on a shared machine it is
part of the result (a thread whose core is busy stalls the others at every barrier).

    python bench/cpu_threads.py                          # tiny UNet and an SD 1.5-width UNet, 6 pairs each
    python bench/cpu_threads.py --sizes tiny --pairs 20

The large UNet is SD 1.5's (block widths 320-1280, 2 layers per block, 8 heads; 860 M parameters) with random
weights and the tiny text encoder (cross-attention width 32), trained at 128 px (16x16 latents), batch 1.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

SD15_WIDTH_UNET = dict(block_out_channels=(320, 640, 1280, 1280), layers_per_block=2, attention_head_dim=8,
                       norm_num_groups=32, sample_size=16)


def build_model(size: str, folder: Path) -> Path:
    from stabletune_core.models.sd.tiny import UNET_CONFIG, build_tiny_sd1

    model = build_tiny_sd1(folder / "model", seed=0)
    if size == "sd15":
        import torch
        from diffusers import UNet2DConditionModel

        torch.manual_seed(0)
        UNet2DConditionModel(**{**UNET_CONFIG, **SD15_WIDTH_UNET}).save_pretrained(model / "unet")
    return model


def measure(size: str, pairs: int, many: int) -> dict:
    import torch

    from stabletune_core.config import build_config
    from stabletune_core.demo import draw_demo_dataset
    from stabletune_core.train.loop import setup, training_step
    from stabletune_core.train.step import next_batches
    from stabletune_core.train.threads import choose_cpu_threads

    tmp = Path(tempfile.mkdtemp(prefix="stabletune-bench-threads-"))
    resolution = 64 if size == "tiny" else 128
    model = build_model(size, tmp)
    data = draw_demo_dataset(tmp / "data", count=8, size=resolution, seed=0)
    config = build_config(dict(
        pretrained_model_name_or_path=str(model), train_data_dir=str(data), output_dir=str(tmp / "run"),
        resolution=resolution, bucket_step=8, min_bucket_reso=resolution // 2, max_bucket_reso=resolution * 2,
        train_batch_size=1 if size == "sd15" else 2, lora_rank=4, learning_rate=1e-4, max_train_steps=10**6,
        seed=0, validation_split=0.0))
    s = setup(config)
    for module in s.trained.values():
        module.train()
    parameters = sum(p.numel() for p in s.bundle.denoiser.parameters())

    def step(threads: int) -> float:
        torch.set_num_threads(threads)
        batches = next_batches(s, 1)
        start = time.perf_counter()
        training_step(s, batches)
        s.state.step += 1
        return time.perf_counter() - start

    step(1), step(many)  # warm-up
    load_before = os.getloadavg()[0]
    times: dict[int, list[float]] = {1: [], many: []}
    ratios = []
    for i in range(pairs):
        order = (1, many) if i % 2 == 0 else (many, 1)
        pair = {threads: step(threads) for threads in order}
        for threads, seconds in pair.items():
            times[threads].append(seconds)
        ratios.append(pair[many] / pair[1])
    os.environ.pop("OMP_NUM_THREADS", None)  # what the rule picks when nobody chose
    rule, why = choose_cpu_threads(parameters)
    return dict(size=size, parameters=parameters, one=statistics.median(times[1]),
                many=statistics.median(times[many]), ratio=statistics.median(ratios), load_before=load_before,
                load_after=os.getloadavg()[0], rule=rule, why=why)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,sd15", help="comma-separated: tiny, sd15")
    parser.add_argument("--pairs", type=int, default=6, help="1-thread / N-thread step pairs per model")
    parser.add_argument("--threads", type=int, default=None, help="N (default: every usable core)")
    args = parser.parse_args()

    from stabletune_core.train.threads import usable_cores

    many = args.threads or usable_cores()
    print(f"{usable_cores()} usable cores; N = {many} threads; {args.pairs} ABBA pairs per model")
    print(f"{'UNet':<6} {'params':>8} {'s/step 1 thread':>16} {f's/step {many} threads':>17} {'median N/1':>11} "
          f"{'load avg before/after':>22}  rule picks")
    for size in args.sizes.split(","):
        r = measure(size, args.pairs, many)
        print(f"{r['size']:<6} {r['parameters'] / 1e6:>7.1f}M {r['one']:>16.3f} {r['many']:>17.3f} {r['ratio']:>11.2f} "
              f"{r['load_before']:>10.1f} / {r['load_after']:<9.1f}  {r['rule']} ({r['why']})", flush=True)


if __name__ == "__main__":
    main()
