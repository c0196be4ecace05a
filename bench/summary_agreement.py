"""Does the run's own learning summary agree with the 8-seed measure? (issue 35.3)

For each training seed, the SD 1.x demo (presets/demo.toml, the demo dataset) trains once in this process; its
exported LoRA is judged twice:
- the 8-seed measure (toy/evaluate.learning_report over seeds 1000-1007, every base prompt and the concept's):
  pass when purple is within 8 degrees of its training images and every base colour within 3 of the base;
- the summary a run would print (toy/judge.learning_summary, the real judge on a run folder holding a step-0 and a
  last sampling) for each candidate validation set: which prompts, and how many seeds from the training seed on, as
  the engine picks them (validation_images.sample_seeds). The candidates' images are rendered by the toy pipeline
  with the base and with the LoRA, a prompt's seeds in one batch, as the engine's validation images are drawn.
Prints one row per training seed and the agreement of each candidate (pass / not yet on what it measured, against
the 8-seed verdict; and how often its summary says 'no verdict' because a kept colour went unmeasured).

    STABLETUNE_CACHE=/tmp/sa/cache OMP_NUM_THREADS=1 python bench/summary_agreement.py --out /tmp/sa --seeds 4,5,2,3,7,1,123
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from stabletune_core.toy.world import BASE_COLORS, CONCEPT_COLOR, SHAPES, base_prompts, concept_prompts  # noqa: E402

#: name -> (validation prompts, seeds per prompt). "shipped-v1": the demo's validation set before issue 35.3;
#: "every prompt x 2": the one before final_validation_images; SHIPPED: the demo's own, read from its preset below.
SHIPPED = "shipped: every prompt x 2, last sampling x final_validation_images"
CANDIDATES = {
    "shipped-v1 (5 prompts x 2)": (concept_prompts() + ["a red circle", "a green square"], 2),
    "one shape a colour x 4": (concept_prompts() + [f"a {c} {SHAPES[i % 3]}" for i, c in enumerate(BASE_COLORS)], 4),
    "every prompt x 2": (concept_prompts() + base_prompts(), 2),
    "every prompt x 4": (concept_prompts() + base_prompts(), 4),
    "every prompt x 8": (concept_prompts() + base_prompts(), 8),
}


def fake_run(folder: Path, data: Path, prompts: list[str], seeds: list[int], base: dict, tuned: dict) -> Path:
    """A run folder as the engine leaves it: config.toml naming the dataset, step 0 (the base) and step 400."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.toml").write_text(f'train_data_dir = "{data}"\ncaption_extension = ".txt"\n')
    for step, images in ((0, base), (400, tuned)):
        samples = folder / "samples" / f"step_{step:06d}"
        samples.mkdir(parents=True, exist_ok=True)
        for p, prompt in enumerate(prompts):
            for i, seed in enumerate(seeds):
                images[prompt][i].save(samples / f"p{p:02d}_s{seed}.png")
        (samples / "prompts.json").write_text(json.dumps({"prompts": prompts, "seeds": seeds}))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", default="7,1,123", help="training seeds, comma-separated")
    args = parser.parse_args()

    import torch

    from stabletune_core.cli import run_train
    from stabletune_core.config import build_config
    from stabletune_core.demo import demo_config
    from stabletune_core.toy import load_toy_pipeline
    from stabletune_core.toy.evaluate import SCORE_SEEDS, learning_report, render, report_passes
    from stabletune_core.toy.judge import concept_reference, judge_samples, learning_summary, passed
    from stabletune_core.train.validation_images import sample_seeds

    torch.set_num_threads(1)
    prompts = concept_prompts() + base_prompts()
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        run_dir = args.out / f"seed{seed}"
        config = demo_config(run_dir, seed=seed)
        # the demo's last sampling: its prompts at the seeds the engine draws there (validation_images.sample_seeds)
        CANDIDATES[SHIPPED] = (config.validation_prompts, len(sample_seeds(config, final=True)))
        if not (run_dir / "output" / f"{config.output_name}.safetensors").is_file():
            config = build_config({**config.model_dump(), "output_dir": str(run_dir), "validation_prompt": None})
            if run_train(config) != 0:
                raise SystemExit(f"the seed-{seed} run failed; see {run_dir}")
        torch.set_num_threads(1)
        model, data = Path(config.pretrained_model_name_or_path), Path(config.train_data_dir)
        base_pipe = load_toy_pipeline(model)
        pipe = load_toy_pipeline(model)
        lora = run_dir / "output" / f"{config.output_name}.safetensors"
        pipe.load_lora_weights(str(lora.parent), weight_name=lora.name, adapter_name="demo")
        reference = concept_reference(run_dir, CONCEPT_COLOR)
        report = learning_report(render(base_pipe, prompts, SCORE_SEEDS), render(pipe, prompts, SCORE_SEEDS),
                                 reference)
        validation_seeds = [seed + i for i in range(max(k for _, k in CANDIDATES.values()))]
        base, tuned = render(base_pipe, prompts, validation_seeds), render(pipe, prompts, validation_seeds)
        row = {"seed": seed, "report": report, "pass8": report_passes(report), "summaries": {}, "passed": {}}
        for name, (chosen, count) in CANDIDATES.items():
            folder = fake_run(args.out / "summaries" / f"seed{seed}" / name.split(" (")[0].replace(" ", "_"),
                              data, chosen, validation_seeds[:count], base, tuned)
            row["summaries"][name] = learning_summary(folder)
            measures = judge_samples(folder / "samples" / "step_000400", folder)
            row["passed"][name], row.setdefault("images", {})[name] = passed(measures), measures["images"]
        rows.append(row)
        with open(args.out / "agreement.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        drift = ", ".join(f"{c} {d:.1f}" for c, d in report["drift"].items())
        verdicts = " | ".join("pass" if ok else "not yet" for ok in row["passed"].values())
        print(f"| {seed} | {report['concept_after']:.1f} | {drift} | {'pass' if row['pass8'] else 'not yet'} | "
              f"{verdicts} |", flush=True)
    print("agreement with the 8-seed verdict:")
    for name in CANDIDATES:
        agree = sum(r["passed"][name] == r["pass8"] for r in rows)
        unsure = sum("no verdict" in r["summaries"][name] for r in rows)
        print(f"  {name}: {agree} of {len(rows)}, {agree / len(rows):.0%} (reads {rows[0]['images'][name]} images; its "
              f"summary says 'no verdict' in {unsure}: a kept colour unmeasured)")


if __name__ == "__main__":
    main()
