"""Time to the first optimizer step and seconds per step: StableTune vs diffusers' example script, side by side
(issue 21 item 5).

Each trainer runs as its own process under bench/step_probe.py, which notes the wall time at the end of every
optimizer step with one global torch hook, the same for both. "First step" is from the process start (Popen)
to the end of optimizer step 1: interpreter start, imports, model load, dataset preparation and anything a
trainer does before training all count. "s/step" is (end of step N - end of step 10) / (N - 10), snapshots
(checkpoints every --snapshot-steps steps) included. Every run is configured for 400 steps (the demo's length)
and stopped with Ctrl-C once it has ended step N.

Rows, all on the toy base and the demo dataset (36 images), seed 7, 64 px, rank 8, batch 4, lr 1e-3:
- StableTune, same work as the example: presets/demo.toml with what the example does not do turned off (no
  text-encoder LoRA, no validation images, no validation loss, no held-out split), a checkpoint every 10 steps;
- StableTune, same work, latents cached: the same with `cache_latents` (the demo preset's setting): each image
  is VAE-encoded once, before step 1, instead of every step;
- diffusers example (`examples/text_to_image/train_text_to_image_lora.py`, never committed), --checkpointing_steps 10;
- StableTune as shipped (presets/demo.toml: text-encoder LoRA, 10 step-0 validation images, validation loss
  every 25 steps), a checkpoint every 10 steps: what a demo user waits for.
Rounds run the rows in ABC CBA order, so a load change during the bench hits every row alike; each row's
numbers are medians over rounds, and the ratios are StableTune / example.

    python bench/first_step.py --peer-script /tmp/peer/train_text_to_image_lora.py --peer-pythonpath /tmp/peerlib \\
        --steps 40 --rounds 2 --threads 2 --out /tmp/first-step
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from toy_quality import PRESET, check_peer, dataset_images, thread_env, write_imagefolder  # noqa: E402

PROBE = ROOT / "bench" / "step_probe.py"
STOP_GRACE_S = 120
WITHOUT_WHAT_THE_EXAMPLE_DOES_NOT_DO = ["--no-train_text_encoder", "--validation_prompt", "", "--validation_loss_every",
                                        "0", "--validation_split", "0", "--sample_judge", "none"]
# The example encodes every batch with the VAE, so the same-work row does too (the demo preset caches latents).
SAME_WORK = [*WITHOUT_WHAT_THE_EXAMPLE_DOES_NOT_DO, "--no-cache_latents"]
SAME_WORK_CACHED = [*WITHOUT_WHAT_THE_EXAMPLE_DOES_NOT_DO, "--cache_latents"]


def stabletune(model: Path, data: Path, run: Path, steps: int, snapshot_steps: int,
               overrides: list[str]) -> list[str]:
    """The demo preset's own length (400 steps): the bench stops the run after `steps` (see `timed`), so that
    what depends on the run's length (the cosine schedule, how the step-0 images are spread) is as a user has it."""
    return ["-m", "stabletune_core", "train", "--config", str(PRESET), "--pretrained_model_name_or_path",
            str(model), "--train_data_dir", str(data), "--output_dir", str(run),
            "--save_steps", str(snapshot_steps), "--checkpoints_total_limit", "100000",
            *overrides]


def peer(script: Path, model: Path, data: Path, run: Path, steps: int, snapshot_steps: int) -> list[str]:
    return [str(script), "--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data),
            "--output_dir", str(run), "--cache_dir", str(run / "hf-cache"), "--resolution", "64", "--rank", "8",
            "--seed", "7", "--train_batch_size", "4", "--learning_rate", "1e-3", "--max_train_steps", "400",
            "--checkpointing_steps", str(snapshot_steps)]


def step_count(times: Path) -> int:
    try:
        return times.read_text().count("\n")
    except FileNotFoundError:
        return 0


def timed(command: list[str], env: dict[str, str], times: Path, log: Path, steps: int, cwd: Path = ROOT
          ) -> dict[str, float]:
    """Run one trainer under the probe; first step s, s/step from step 10 to the last, peak RSS and CUDA memory
    (MiB) up to the last step, load average."""
    load = os.getloadavg()[0]
    with open(log, "w") as out:
        started = time.time()
        process = subprocess.Popen([sys.executable, str(PROBE), str(times), *command], env=env, cwd=cwd, stdout=out,
                                   stderr=subprocess.STDOUT)
        while process.poll() is None and step_count(times) < steps:
            time.sleep(0.2)
        if process.poll() is None:  # both trainers stop on Ctrl-C (StableTune saves first); the times are in
            process.send_signal(signal.SIGINT)
            try:
                process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    rows = {int(fields[0]): [float(f) for f in fields[1:]] for fields in
            (line.split() for line in times.read_text().splitlines())}
    ends = {step: row[0] for step, row in rows.items()}
    if len(ends) < steps:
        raise SystemExit(f"{command[:3]} ended with code {process.returncode} after {len(ends)} steps; see {log}.")
    peaks = rows[steps][1:] + [0.0, 0.0]  # (peak RSS, peak CUDA) in MiB up to the last measured step
    return {"first_step_s": ends[1] - started, "step10_s": ends[10] - started, "last_step_s": ends[steps] - started,
            "sec_per_step": (ends[steps] - ends[10]) / (steps - 10), "peak_rss_mib": peaks[0],
            "peak_cuda_mib": peaks[1], "load": load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peer-script", type=Path, required=True)
    parser.add_argument("--peer-pythonpath", default=None)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--snapshot-steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--before-root", type=Path, default=None,
                        help="a checkout of an earlier StableTune (e.g. `git archive COMMIT | tar -x -C DIR`): adds "
                             "its demo preset as shipped as a row, for a before/after")
    args = parser.parse_args()
    if args.steps <= 10:
        raise SystemExit("--steps must be above 10 (seconds per step are measured from step 10 on).")
    check_peer(args)
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"--out {args.out} is not empty; give the bench a new folder (it never overwrites).")
    args.out.mkdir(parents=True, exist_ok=True)

    from stabletune_core.demo import demo_assets

    model, data = demo_assets()
    peer_data = write_imagefolder(dataset_images(data), args.out / "peer-data")
    rows = {
        "StableTune, same work as the example": lambda run: stabletune(model, data, run, args.steps,
                                                                       args.snapshot_steps, SAME_WORK),
        "StableTune, same work, latents cached": lambda run: stabletune(model, data, run, args.steps,
                                                                        args.snapshot_steps, SAME_WORK_CACHED),
        "diffusers example": lambda run: peer(args.peer_script, model, peer_data, run, args.steps,
                                              args.snapshot_steps),
        "StableTune as shipped (demo preset)": lambda run: stabletune(model, data, run, args.steps,
                                                                      args.snapshot_steps, []),
    }
    if args.before_root:
        rows["StableTune as shipped, before"] = lambda run: stabletune(model, data, run, args.steps,
                                                                      args.snapshot_steps, [])
    results: dict[str, list[dict[str, float]]] = {name: [] for name in rows}
    for r in range(args.rounds):
        order = list(rows) if r % 2 == 0 else list(reversed(rows))
        for name in order:
            index = list(rows).index(name)
            run = args.out / f"round{r}-row{index}"
            env = thread_env(args.threads, args.peer_pythonpath if name == "diffusers example" else None)
            root = args.before_root.resolve() if name.endswith("before") else ROOT
            env["PYTHONPATH"] = env["PYTHONPATH"].replace(str(ROOT), str(root), 1)
            result = timed(rows[name](run), env, args.out / f"round{r}-row{index}.times",
                           args.out / f"round{r}-row{index}.log", args.steps, cwd=root)
            results[name].append(result)
            print(f"round {r}: {name}: {json.dumps({k: round(v, 3) for k, v in result.items()})}", file=sys.stderr)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    peer_row = {k: statistics.median(x[k] for x in results["diffusers example"]) for k in ("first_step_s",
                                                                                            "sec_per_step")}
    print(f"\n{args.threads} threads, {args.steps} steps, a snapshot every {args.snapshot_steps} steps, "
          f"{args.rounds} rounds (medians)")
    print(f"| trainer | first step (s) | step 10 (s) | step {args.steps} (s) | s/step, steps 10-{args.steps} | "
          "first step vs example | s/step vs example | load avg at each start |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, runs in results.items():
        first, tenth, last, per = (statistics.median(x[k] for x in runs)
                                   for k in ("first_step_s", "step10_s", "last_step_s", "sec_per_step"))
        loads = ", ".join(f"{x['load']:.1f}" for x in runs)
        print(f"| {name} | {first:.1f} | {tenth:.1f} | {last:.1f} | {per:.3f} | "
              f"{first / peer_row['first_step_s']:.2f} | {per / peer_row['sec_per_step']:.2f} | {loads} |")


if __name__ == "__main__":
    main()
