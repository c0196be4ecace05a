"""Does the judge-free perceptual drift move with the toy judge's degrees? (issue 35.5)

Trains the SD 1.x demo (presets/demo.toml) at each training seed through the engine, sampling every `--every` steps
(the demo's own 200 gives two points a run; more samplings give the early, larger drifts too). Each run's
perceptual-drift observer writes RUN/diagnostics/perceptual_drift.jsonl as it would in any run; this script then
measures the same images with the toy judge (toy/score.py, in degrees) and correlates, over every sampling after
step 0, every prompt and every seed:
- a kept prompt's perceptual drift (against the base's step-0 image, same prompt and seed) with its hue drift in
  degrees against that same image;
- a concept prompt's distance to the nearest training image with its hue error in degrees against the training
  images (toy/judge.concept_reference), after step 0 and with step 0 (the base's images, far from the concept).
Pearson and Spearman, per image and per (run, step, prompt) mean. It also reads, from each run's events, how long
the last sampling (final_validation_images: 8 seeds a prompt and the base's images at the 6 extra seeds) took beside
an ordinary one (issue 35.3's cost).

    STABLETUNE_CACHE=/tmp/pd/cache OMP_NUM_THREADS=1 python bench/perceptual_drift.py --out /tmp/pd --seeds 7,1
    (--remeasure: finished runs' images measured again with this checkout's observer, no training)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing


def train_demo(out: Path, seed: int, every: int) -> Path:
    """The SD demo at training seed `seed`, sampling every `every` steps, in out/seedN (kept when it finished)."""
    from stabletune_core.cli import run_train
    from stabletune_core.config import build_config
    from stabletune_core.demo import demo_config

    run = out / f"seed{seed}"
    status = run / "status.json"
    if status.is_file() and json.loads(status.read_text()).get("state") == "finished":
        return run
    config = demo_config(run, seed=seed)
    config = build_config({**config.model_dump(), "output_dir": str(run), "validation_steps": every})
    if run_train(config) != 0:
        raise SystemExit(f"the seed-{seed} run failed; see {run}")
    return run


def remeasure(run: Path) -> None:
    """Rewrite RUN/diagnostics/perceptual_drift.jsonl with this checkout's observer, over the run's own images (the
    same measure_sampling the observer runs at each sampling): a change of the measure needs no new training."""
    import torch

    from stabletune_core.config import build_config, read_toml
    from stabletune_core.data.scan import scan_dataset
    from stabletune_core.models.loading import load_model
    from stabletune_core.runs.layout import RunPaths
    from stabletune_core.train.observers.perceptual_drift import PerceptualDrift

    config = build_config(read_toml(RunPaths(run).config))
    items = scan_dataset(Path(config.train_data_dir), caption_extension=config.caption_extension).items
    observer = PerceptualDrift(config, load_model(config), torch.device("cpu"), items)
    records = [observer.measure_sampling(folder, run) for folder in RunPaths(run).sample_folders()]
    RunPaths(run).perceptual_drift.write_text("".join(json.dumps(r) + "\n" for r in records))


def points(run: Path) -> list[dict]:
    """One point per image of every sampling after step 0: its perceptual value and the toy judge's degrees."""
    from PIL import Image

    from stabletune_core.runs.layout import RunPaths, sample_image_name
    from stabletune_core.toy.judge import concept_reference
    from stabletune_core.toy.score import caption_parts, hue_distance, judge
    from stabletune_core.toy.world import BASE_COLORS
    from stabletune_core.train.observers.perceptual_drift import read_records

    paths = RunPaths(run)
    base_meta = json.loads((paths.sample_dir(0) / "prompts.json").read_text())
    base_index = {prompt: i for i, prompt in enumerate(base_meta["prompts"])}
    hues: dict[Path, float] = {}

    def hue(path: Path) -> float:
        if path not in hues:
            with Image.open(path) as image:
                hues[path] = judge(image).hue
        return hues[path]

    references: dict[str, float] = {}
    found = []
    for record in read_records(paths.perceptual_drift):
        step = record["step"]
        meta = json.loads((paths.sample_dir(step) / "prompts.json").read_text())
        for p, prompt in enumerate(meta["prompts"]):
            color, _ = caption_parts(prompt)
            kept = prompt in record["kept"]
            values = (record["drift"] if kept else record["nearest"]).get(prompt, {}).get("seeds", {})
            for seed, value in values.items():
                image = paths.sample_dir(step) / sample_image_name(p, int(seed))
                if kept:
                    if color not in BASE_COLORS or step == 0:  # step 0 against itself: 0 and 0
                        continue  # a kept prompt the toy judge has no colour for
                    degrees = hue_distance(hue(image), hue(paths.sample_dir(0) / sample_image_name(
                        base_index[prompt], int(seed))))
                else:
                    if color not in references:
                        references[color] = concept_reference(run, color)
                    degrees = hue_distance(hue(image), references[color])
                found.append({"run": run.name, "step": step, "prompt": prompt, "seed": int(seed),
                              "kind": "kept" if kept else "concept", "value": value, "degrees": degrees})
    return found


def correlations(rows: list[dict]) -> dict[str, float]:
    import pandas as pd

    frame = pd.DataFrame(rows)
    if len(frame) < 3:
        return {"n": len(frame), "pearson": math.nan, "spearman": math.nan}
    return {"n": len(frame), "pearson": float(frame["value"].corr(frame["degrees"], method="pearson")),
            "spearman": float(frame["value"].corr(frame["degrees"], method="spearman")),
            "degrees_range": (float(frame["degrees"].min()), float(frame["degrees"].max()))}


def means(rows: list[dict]) -> list[dict]:
    """Per (run, step, prompt): the mean over its seeds."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["run"], row["step"], row["prompt"]), []).append(row)
    return [{"value": sum(r["value"] for r in g) / len(g), "degrees": sum(r["degrees"] for r in g) / len(g)}
            for g in groups.values()]


def sampling_seconds(run: Path) -> dict[int, float]:
    """Seconds each sampling after step 0 took: from the step's metrics line to its 'Made N validation images'."""
    metrics = {json.loads(line)["step"]: json.loads(line)["time"]
               for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()}
    seconds = {}
    for line in (run / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event.get("kind") == "samples" and event.get("step") in metrics and event["step"] > 0 \
                and event["message"].startswith("Made"):
            seconds[event["step"]] = event["time"] - metrics[event["step"]]
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", default="7,1", help="training seeds of the SD demo, comma-separated")
    parser.add_argument("--every", type=int, default=100, help="validation_steps of the bench's runs")
    parser.add_argument("--remeasure", action="store_true", help="re-measure finished runs with this checkout's "
                        "observer before correlating")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)  # the toy model is dispatch-bound
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        run = train_demo(args.out, seed, args.every)
        if args.remeasure:
            remeasure(run)
        rows += points(run)
        timing = sampling_seconds(run)
        print(f"seed {seed}: sampling seconds by step {timing}", flush=True)
    (args.out / "points.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print("| points | n | degrees (min-max) | Pearson | Spearman |")
    print("|---|---|---|---|---|")
    for kind, what, steps in (("kept", "kept prompts: drift vs hue drift (deg), after step 0", 1),
                              ("concept", "concept prompts: nearest training image vs hue error (deg), after step 0",
                               1),
                              ("concept", "concept prompts: the same with step 0 (the base's images)", 0)):
        chosen = [r for r in rows if r["kind"] == kind and r["step"] >= steps]
        for label, data in (("per image", chosen), ("per run x step x prompt", means(chosen))):
            c = correlations(data)
            span = c.get("degrees_range", (math.nan, math.nan))
            print(f"| {what}, {label} | {c['n']} | {span[0]:.1f}-{span[1]:.1f} | {c['pearson']:.2f} | "
                  f"{c['spearman']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
