"""One trial of a demo's settings, measured as tests/test_toy_klein.py and tests/test_toy_learning.py measure the
demos (issues 23.5 and 21.4).

The demo (`--family flux2_klein`, the default: `presets/demo-flux2-klein.toml` on the toy Klein base; `--family sd1`:
`presets/demo.toml` on the toy SD 1.x base; `--family z_image`: `presets/demo-z_image.toml` on the toy Z-Image base;
each with the demo dataset: 12 purple shapes and the base's own images
of the colours it knows), with `--set knob=value` overrides (TOML values), trains once in this process; its exported
LoRA is then loaded into a fresh toy pipeline with diffusers' `load_lora_weights` and judged over 8 seeds per
prompt (toy/evaluate.learning_report): purple's hue error in degrees against the run's own training images, each
base colour's drift in degrees against the base's own image at the same prompt and seed, and the base prompts'
shapes right. The base's renders are kept under OUT/base and reused by every trial of OUT.

    STABLETUNE_CACHE=/tmp/kd/cache OMP_NUM_THREADS=1 python bench/klein_demo_trials.py --out /tmp/kd \\
        --name lr2e-3 --set learning_rate=2e-3

Each trial appends a JSON line to OUT/trials.jsonl and prints a table row: settings -> purple error, drift per colour,
shapes, the run's seconds (train() alone: model load, training, validation images, export; not imports) and the load
average at its start.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing


def parse_overrides(pairs: list[str]) -> dict:
    """{"learning_rate": 0.002} from ["learning_rate=2e-3"]; values are TOML ("logit_normal" needs its quotes)."""
    values = {}
    for pair in pairs:
        key, _, text = pair.partition("=")
        try:
            values[key.strip()] = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            values[key.strip()] = text.strip()  # a bare word: a string
    return values


def images_in(folder: Path, prompts: list[str], seeds: list[int]) -> dict[str, list] | None:
    from PIL import Image

    paths = {p: [folder / f"{p.replace(' ', '_')}_s{s}.png" for s in seeds] for p in prompts}
    if not all(path.is_file() for group in paths.values() for path in group):
        return None
    return {p: [Image.open(path).convert("RGB") for path in group] for p, group in paths.items()}


def save_images(folder: Path, images: dict[str, list], seeds: list[int]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for prompt, group in images.items():
        for seed, image in zip(seeds, group):
            image.save(folder / f"{prompt.replace(' ', '_')}_s{seed}.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder of the trials (runs, base renders, table).")
    parser.add_argument("--name", required=True, help="The trial's name (its run folder under OUT/runs).")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KNOB=VALUE")
    from stabletune_core.toy.bases import TOY_BASES

    parser.add_argument("--family", choices=list(TOY_BASES), default="flux2_klein",
                        help="which demo: the toy FLUX.2 Klein's, the toy SD 1.x's or the toy Z-Image's")
    args = parser.parse_args()

    import torch

    from stabletune_core.cli import run_train
    from stabletune_core.config import build_config
    from stabletune_core.demo import demo_config
    from stabletune_core.toy.evaluate import SCORE_SEEDS, learning_report, render
    from stabletune_core.toy.judge import concept_reference, learning_summary
    from stabletune_core.toy.world import CONCEPT_COLOR, base_prompts, concept_prompts

    torch.set_num_threads(1)  # the toy models are dispatch-bound (train/threads.py)
    load_pipeline = TOY_BASES[args.family].pipeline
    overrides = parse_overrides(args.overrides)
    run_dir = args.out / "runs" / args.name
    if run_dir.exists():
        raise SystemExit(f"{run_dir} exists; give the trial another --name.")
    config = demo_config(run_dir, family=args.family)  # builds the toy base and the demo dataset once per cache
    config = build_config({**config.model_dump(), **overrides, "output_dir": str(run_dir)})
    model = Path(config.pretrained_model_name_or_path)
    prompts = base_prompts() + concept_prompts()
    base = images_in(args.out / "base", prompts, SCORE_SEEDS)
    if base is None:
        base = render(load_pipeline(model), prompts, SCORE_SEEDS)
        save_images(args.out / "base", base, SCORE_SEEDS)

    load = os.getloadavg()[0]
    started = time.perf_counter()
    code = run_train(config)
    seconds = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"the trial's run failed ({code}); see {run_dir}")
    torch.set_num_threads(1)
    pipe = load_pipeline(model)
    lora = run_dir / "output" / f"{config.output_name}.safetensors"
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name, adapter_name="demo")
    tuned = render(pipe, prompts, SCORE_SEEDS)
    save_images(run_dir / "judged", tuned, SCORE_SEEDS)  # what was judged, beside the run
    report = learning_report(base, tuned, concept_reference(run_dir, CONCEPT_COLOR))
    row = {"name": args.name, "overrides": overrides, "run_seconds": round(seconds, 1), "load_average": load,
           **report, "summary": learning_summary(run_dir),
           "utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    with open(args.out / "trials.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    drift = ", ".join(f"{c} {d:.1f}" for c, d in report["drift"].items())
    settings = ", ".join(f"{k} {v}" for k, v in overrides.items()) or "the preset"
    print(f"| {args.name} | {settings} | {report['concept_before']:.1f} -> {report['concept_after']:.1f} | {drift} | "
          f"{report['shapes']:.0%} | {seconds:.0f} s | {load:.2f} |")


if __name__ == "__main__":
    main()
