"""Checkpoint grid vs. the run's own sampling: seconds per image, side by side on the same machine (issue 37.5).

The grid (`python -m stabletune_core grid`, stabletune_core/grid.py) must make an image as fast as a sampling
inside training does. This bench trains a short run of the toy base (its validation prompts x seeds sampled at
steps 0, 3 and 6, checkpoints at 3 and 6), then alternates, in ABBA order so a drift in the machine's load hits
both alike:

  A  the run's sampling as training makes it: a process that loads the run's model with its adapters, chooses its
     CPU threads as training does (train/threads.py) and times one make_validation_images call over every prompt
     x seed (what the loop calls at a validation step);
  B  the grid command as the UI starts it (no OMP_NUM_THREADS): its rendering time per image, from RUN/grids/
     NAME.json (`rendering_since` .. `ended_at`: the model load is left out, as it is for A).

It prints each pair and the median ratio B/A; the load average before and after (on a shared machine it is part
of the result). Before issue 37.5 the grid took torch's one thread per core, and a call per seed: on a loaded
2-core machine B/A was 15-30 (a 36-image grid of the toy base: ~35 s per image against ~1.2-2 s).

    python bench/grid_speed.py                # 2 pairs
    python bench/grid_speed.py --pairs 4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing


def make_run(folder: Path) -> Path:
    from stabletune_core.demo import draw_demo_dataset
    from stabletune_core.launch import engine_env, write_run_config
    from stabletune_core.toy import WEIGHTS, materialize

    model = materialize(WEIGHTS, folder / "toy-base")
    data = draw_demo_dataset(folder / "data", count=8, size=64, seed=0)
    run = write_run_config(dict(pretrained_model_name_or_path=str(model), train_data_dir=str(data),
                                output_dir=str(folder / "run"), resolution=64, train_batch_size=4, max_train_steps=6,
                                lora_rank=4, seed=3, validation_loss_every=0, num_validation_images=2,
                                validation_prompt="a red circle | a blue square", validation_steps=3, save_steps=3))
    done = subprocess.run([sys.executable, "-m", "stabletune_core", "train", "--config", str(run / "config.toml")],
                          cwd=ROOT, env=engine_env(), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the bench's run failed: {done.stderr[-1500:]}")
    return run


def sample_as_training(run: Path) -> float:
    """Seconds per image of one validation sampling of `run`, made as the training loop makes it (process A)."""
    import torch

    from stabletune_core.config import TrainConfig
    from stabletune_core.grid import load_with_adapters
    from stabletune_core.train.threads import set_cpu_threads
    from stabletune_core.train.validation_images import image_count, make_validation_images

    config = TrainConfig.from_toml(run / "config.toml")
    device = torch.device("cpu")
    bundle, _, autocast, _ = load_with_adapters(config, device)
    set_cpu_threads(bundle.denoiser)
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        make_validation_images(bundle, config, Path(folder), device, autocast=autocast)
        return (time.perf_counter() - start) / image_count(config)


def grid_per_image(run: Path, name: str) -> float:
    """Seconds per image of the grid command as the UI starts it (process B)."""
    from stabletune_core.launch import engine_env

    env = {k: v for k, v in engine_env().items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, "-m", "stabletune_core", "grid", str(run), "--checkpoints", "all",
                           "--name", name], cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the grid failed: {done.stderr[-1500:]}")
    meta = json.loads((run / "grids" / f"{name}.json").read_text())
    images = len(meta["cells"])
    return (meta["ended_at"] - meta["rendering_since"]) / images


def timed_sampling(run: Path) -> float:
    """Process A in a process of its own (a fresh interpreter, as a training's is)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run([sys.executable, __file__, "--sample", str(run)], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(f"the sampling failed: {done.stderr[-1500:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--sample", type=Path, help=argparse.SUPPRESS)  # process A
    args = parser.parse_args()
    if args.sample:
        print(sample_as_training(args.sample))
        return
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory(prefix="grid-speed-") as folder:
        run = make_run(Path(folder))
        ratios = []
        for pair in range(args.pairs):
            order = ("A", "B") if pair % 2 == 0 else ("B", "A")
            seconds = {}
            for which in order:
                seconds[which] = timed_sampling(run) if which == "A" else grid_per_image(run, f"bench-{pair}")
            ratios.append(seconds["B"] / seconds["A"])
            print(f"pair {pair + 1}: in-run sampling {seconds['A']:.2f} s/image, grid {seconds['B']:.2f} s/image, "
                  f"grid / in-run = {ratios[-1]:.2f}")
    print(f"median grid / in-run seconds per image: {statistics.median(ratios):.2f} over {len(ratios)} pairs")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
