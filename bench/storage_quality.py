"""What base_storage costs in quality and speed (issue 36 item 4): the toy demos trained with the frozen base kept
full, int8 or nf4 (the storages that run on a CPU; fp8 needs a GPU), measured as the concept suite measures
(bench/concept_suite.py, reused: the demo's concept, purple, from its 12 drawn images beside the base's own prior
images, the demo's preset, no validation images, 8 render seeds per prompt):

- concept error: purple's hue error in degrees against its own training images;
- worst kept-colour drift: the largest of red/yellow/green/cyan's drift in degrees against the base's own image at the
  same prompt and seed;
- shapes: the base prompts' shapes drawn right;
- CPU s/step: the median of the run's logged seconds per step (metrics.jsonl), one run at a time on this machine;
  on a shared machine the load moves it by a factor of two within minutes, so the speed columns come from
  --speed-rounds short runs taking turns (full, int8, nf4, full, ...), each storage's median over its rounds.

Each is shown beside full storage's (the goal: concept error and worst drift each within 1 degree of full).

    nice -n 5 env OMP_NUM_THREADS=1 python bench/storage_quality.py --out /tmp/sq                 # SD, then Klein
    python bench/storage_quality.py --out /tmp/sq --families sd1 --storages full,int8              # a slice

Writes OUT/rows.jsonl (one line per family x storage x seed, reused by a later run of the same OUT) and OUT/table.md,
the markdown table for bench/RESULTS.md, and prints it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "bench"))

from concept_suite import (Concept, concept_dataset, measure_cell, prior_images, save_row, train_cell,  # noqa: E402
                           write_table)

CPU_STORAGES = ("full", "int8", "nf4")
COLUMNS = ("toy base", "storage", "seed", "steps", "concept error", "vs full", "worst drift", "vs full", "shapes",
           "CPU s/step", "vs full")


def seconds_per_step(run_dir: Path) -> float:
    """The median of the run's logged seconds per step (the loop's moving average, from metrics.jsonl)."""
    from stabletune_core.runs.layout import RunPaths

    lines = RunPaths(run_dir).metrics.read_text().splitlines()
    values = [row["sec_per_step"] for row in map(json.loads, lines) if row.get("sec_per_step")]
    return statistics.median(values)


def speed_rounds(out: Path, concept: Concept, data: Path, model: Path, family: str, storages: list[str], rounds: int,
                 steps: int) -> dict[str, float]:
    """storage -> the median s/step of `rounds` short runs each, the storages taking turns (so a change of the
    machine's load falls on all of them alike)."""
    measured: dict[str, list[float]] = {storage: [] for storage in storages}
    for turn in range(rounds):
        for storage in storages:
            lora, _ = train_cell(out, concept, 7, data, model, family, steps, overrides={"base_storage": storage},
                                 tag=f"-{storage}-speed{turn}")
            measured[storage].append(seconds_per_step(lora.parent.parent))
    return {storage: round(statistics.median(values), 4) for storage, values in measured.items()}


def worst_drift(row: dict) -> float:
    return max(row["drift"].values())


def table(rows: list[dict]) -> str:
    """One line per family x storage x seed, each measure beside full storage's of the same family and seed."""
    full = {(r["family"], r["seed"]): r for r in rows if r["storage"] == "full"}
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        ref = full.get((row["family"], row["seed"]))
        delta = (lambda f: f"{f(row) - f(ref):+.1f} deg") if ref else (lambda f: "")
        speed = f"x{row['s_per_step'] / ref['s_per_step']:.2f}" if ref and row.get("s_per_step") else ""
        cells = [row["family"], row["storage"], str(row["seed"]), str(row["steps"]), f"{row['after']:.1f} deg",
                 delta(lambda r: r["after"]), f"{worst_drift(row):.1f} deg", delta(worst_drift),
                 f"{row['base_shapes']:.0%}".replace("%", " %"),
                 f"{row['s_per_step']:.3f}" if row.get("s_per_step") else "", speed]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder of the bench (data, runs, rows, table).")
    parser.add_argument("--families", default="sd1,flux2_klein", help="comma-separated toy bases: sd1, flux2_klein")
    parser.add_argument("--storages", default=",".join(CPU_STORAGES), help="comma-separated, from full, int8, nf4")
    parser.add_argument("--seeds", type=int, default=1, help="training seeds: the preset's own (7), then 1..N-1")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the preset's)")
    parser.add_argument("--render-seeds", type=int, default=8, help="render seeds per prompt, from 1000")
    parser.add_argument("--speed-rounds", type=int, default=3, help="short runs per storage for the s/step columns")
    parser.add_argument("--speed-steps", type=int, default=60, help="steps of each of those runs")
    args = parser.parse_args(argv)
    storages = args.storages.split(",")
    if bad := [s for s in storages if s not in CPU_STORAGES]:
        parser.error(f"base_storage {bad[0]!r} does not run on a CPU here: choose from {', '.join(CPU_STORAGES)}")

    import torch

    from stabletune_core.toy.bases import TOY_BASES
    from stabletune_core.toy.evaluate import render
    from stabletune_core.toy.judge import concept_reference_in
    from stabletune_core.toy.world import CONCEPT_COLOR, base_prompts

    torch.set_num_threads(1)  # the toy models are dispatch-bound (train/threads.py)
    concept = Concept(CONCEPT_COLOR)
    render_seeds = list(range(1000, 1000 + args.render_seeds))
    training_seeds = [7, *range(1, args.seeds)]
    rows_file = args.out / "rows.jsonl"
    done = {}
    if rows_file.is_file():
        for row in map(json.loads, rows_file.read_text().splitlines()):
            done[(row["family"], row["storage"], row["seed"], row["steps"], row["render_seeds"])] = row
    rows = []
    for family in args.families.split(","):
        out = args.out / family
        out.mkdir(parents=True, exist_ok=True)
        toy = TOY_BASES[family]
        model = toy.model()
        data = concept_dataset(out, concept, prior_images(out, model, family))
        reference = concept_reference_in(data, concept.name)
        base = None
        for seed in training_seeds:
            for storage in storages:
                started = time.perf_counter()
                lora, steps = train_cell(out, concept, seed, data, model, family, args.steps,
                                         overrides={"base_storage": storage}, tag=f"-{storage}")
                key = (family, storage, seed, steps, args.render_seeds)
                if key not in done:
                    torch.set_num_threads(1)
                    if base is None:  # the base's renders, once per family
                        base = render(toy.pipeline(model), base_prompts() + concept.prompts(), render_seeds)
                    row = {"family": family, "storage": storage, "seed": seed, "steps": steps,
                           "render_seeds": args.render_seeds, "reference": reference,
                           **measure_cell(concept, lora, model, base, render_seeds, reference, toy.pipeline),
                           "run_s_per_step": round(seconds_per_step(lora.parent.parent), 4),
                           "seconds": round(time.perf_counter() - started)}
                    done[key] = save_row(rows_file, row)
                rows.append(done[key])
                print(table([done[key]]).splitlines()[-1], flush=True)
        if args.speed_rounds:
            speeds = speed_rounds(out, concept, data, model, family, storages, args.speed_rounds, args.speed_steps)
            for row in rows:
                if row["family"] == family:
                    row["s_per_step"] = speeds[row["storage"]]
    return write_table(args.out, table(rows))


if __name__ == "__main__":
    main()
