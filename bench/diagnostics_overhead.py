"""Overhead of the diagnostics (validation loss, spectra, activation stats) relative to the training step.

One run on the tiny real-architecture SD1 model measures, in the same process: the time of each training
step and the time of each diagnostic evaluation (each guard keeps its own clock). The diagnostics run every
`--every` steps here so that there are enough evaluations to time; the overhead at the default intervals is
then  sum(cost per evaluation / default interval) / step time.  The ratio measured at `--every` is printed too.

    python bench/diagnostics_overhead.py [--steps 40] [--every 10] [--threads 1]

The tiny model on a CPU is dispatch-bound, so the ratio is a rough stand-in for a GPU run on a real model
(there, a training step is heavier relative to the small SVD and the few forward passes).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from stabletune_core.config import TrainConfig, build_config  # noqa: E402
from stabletune_core.demo import draw_demo_dataset  # noqa: E402
from stabletune_core.models.sd.tiny import build_tiny_sd1  # noqa: E402
from stabletune_core.train.loop import setup, train  # noqa: E402

MEASURED = {"validation_loss": "validation_loss_every", "spectra": "diagnostics_every",
            "activations": "activation_stats_every"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    defaults = TrainConfig()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_tiny_sd1(root / "model", seed=0)
        data = draw_demo_dataset(root / "data", count=8, size=64, seed=0)
        config = build_config(dict(
            pretrained_model_name_or_path=str(model), train_data_dir=str(data), output_dir=str(root / "run"),
            resolution=64, bucket_step=8, min_bucket_reso=32, max_bucket_reso=128, train_batch_size=4,
            max_train_steps=args.steps, lora_rank=4, lora_alpha=8, save_steps=10_000, seed=3,
            validation_split=0.25, validation_loss_every=args.every, diagnostics_every=args.every,
            activation_stats_every=args.every))
        session = setup(config)
        start = time.perf_counter()
        train(config, session=session)
        wall = time.perf_counter() - start
    guards = {g.name: g for g in [*session.guards, *session.observers] if g.name in MEASURED}
    evaluations = args.steps // args.every
    diag_total = sum(g.seconds for g in guards.values())
    step_time = (wall - diag_total) / args.steps  # what remains is training (plus the final save and export)
    report = {"steps": args.steps, "every": args.every, "threads": args.threads,
              "step_seconds": round(step_time, 4), "diagnostics_seconds_total": round(diag_total, 3)}
    at_defaults = 0.0
    for name, guard in guards.items():
        knob = MEASURED[name]
        per_eval = guard.seconds / evaluations  # includes the one-off set-up of the fixed sets: an overestimate
        default_every = getattr(defaults, knob)
        share = per_eval / default_every / step_time
        at_defaults += share
        report[name] = {"seconds_per_evaluation": round(per_eval, 4), f"default_{knob}": default_every,
                        "overhead_at_default": f"{100 * share:.2f}%"}
    report["overhead_at_every"] = f"{100 * diag_total / (step_time * args.steps):.2f}%"
    report["overhead_at_defaults"] = f"{100 * at_defaults:.2f}%"
    report["within_2_percent"] = at_defaults <= 0.02
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
