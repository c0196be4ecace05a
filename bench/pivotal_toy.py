"""Pivotal tuning on the toy base, side by side with a LoRA alone: does a new token learn the concept, and what
does each leave of the base's own colours? Measures in degrees of hue, as DESIGN.md asks.

Both runs train the demo's dataset (presets/demo.toml: 12 purple shapes + 24 shapes in the colours the base
knows), with the purple images captioned by a new word, "a <p1> circle", instead of "a purple circle". The LoRA-only
run sees "<p1>" as the text encoder's existing pieces ("<", "p", "1", ">"); the pivotal run adds <p1> as a token
initialised from "red" (`--init`) and trains its embedding with the LoRA. Then, for each run, a fresh diffusers
pipeline of the toy base loads the exported LoRA (its tensors without `bundle_emb.*`, which diffusers'
`load_lora_weights` does not read) and, for the pivotal run, the exported embedding file through
`load_textual_inversion`, as a diffusers user would; it draws every prompt at `--render-seeds` seeds, and the toy
judge's hue (stabletune_core/toy/score.py `judge(image).hue`) gives:

* concept error: each "a <p1> SHAPE" image's hue distance to the mean hue of the concept's training images (an
  image with no object counts 180 degrees);
* base drift: each base-colour prompt's image hue distance to the toy base's own image at the same prompt and seed
  (mean and max).

    python bench/pivotal_toy.py --train-seeds 1,2 --render-seeds 8 --steps 400 --out /tmp/pivotal-bench
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
from stabletune_core.toy.score import circular_mean, hue_distance, judge  # noqa: E402

TOKEN = "<p1>"
SHAPES = ("circle", "square", "triangle")
BASE_PROMPTS = ("a red circle", "a yellow square", "a green triangle", "a cyan circle")
FIRST_RENDER_SEED = 2000


# ---- hue in degrees: the toy judge's own measures ------------------------------------------------------------------
def hue_of(image: Any) -> float:
    return judge(image).hue


# ---- data ----------------------------------------------------------------------------------------------------------
def concept_dataset(source: Path, target: Path, concept: str = "purple") -> tuple[Path, float]:
    """A copy of the demo dataset whose concept captions name the new token ("a purple circle" -> "a <p1> circle");
    returns it and the concept's training images' mean hue."""
    from PIL import Image

    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target)
    hues = []
    for caption in target.rglob("*.txt"):
        text = caption.read_text(encoding="utf-8")
        if concept in text.split():
            caption.write_text(text.replace(concept, TOKEN), encoding="utf-8")
            with Image.open(caption.with_suffix(".png")) as image:
                hues.append(hue_of(image))
    return target, circular_mean(hues)


# ---- training ------------------------------------------------------------------------------------------------------
def train_run(model: Path, data: Path, out: Path, *, seed: int, steps: int, pivotal: bool, init: str = "red",
              **overrides: Any) -> Path:
    """Train the demo preset on `data` into `out` (no validation images: measured afterwards); returns RUN/output."""
    from stabletune_core.config import build_config, read_toml
    from stabletune_core.train.loop import train

    values = read_toml(ROOT / "presets" / "demo.toml")
    values.update(pretrained_model_name_or_path=str(model), train_data_dir=str(data), output_dir=str(out),
                  seed=seed, max_train_steps=steps, validation_prompt=None, sample_judge="none",
                  validation_loss_every=0, diagnostics_every=0, activation_stats_every=0, save_steps=steps,
                  save_precision="fp32", output_name="toy")
    if pivotal:
        values.update(pivotal_tokens=[f"{TOKEN}={init}"])
    values.update(overrides)
    train(build_config(values))
    return out / "output"


# ---- measuring -----------------------------------------------------------------------------------------------------
def lora_pipeline(model: Path, output: Path | None):
    """A fresh toy pipeline with a run's exported LoRA and embedding (None: the base alone), loaded as a diffusers
    user does: the LoRA file's tensors without bundle_emb.*, the embedding file with load_textual_inversion."""
    from safetensors.torch import load_file

    from stabletune_core.toy import load_toy_pipeline

    pipe = load_toy_pipeline(model)
    if output is None:
        return pipe
    lora = {k: v for k, v in load_file(output / "toy.safetensors").items() if not k.startswith("bundle_emb.")}
    pipe.load_lora_weights(lora, adapter_name="toy")
    for embedding in sorted((output / "toy_embeddings").glob("*.safetensors")):
        pipe.load_textual_inversion(str(embedding), token=TOKEN)
    return pipe


def render(pipe: Any, prompt: str, seeds: list[int]) -> list[Any]:
    from stabletune_core.toy.evaluate import render as toy_render

    return toy_render(pipe, [prompt], seeds)[prompt]


def measure(model: Path, output: Path | None, target_hue: float, seeds: list[int],
            base_hues: dict[str, list[float]] | None = None, word: str = TOKEN) -> dict[str, Any]:
    """Concept error and base drift in degrees (see the module's docstring); `word` names the concept."""
    pipe = lora_pipeline(model, output)
    concept = [hue_distance(hue_of(img), target_hue) for s in SHAPES for img in render(pipe, f"a {word} {s}", seeds)]
    result: dict[str, Any] = {"concept_error_deg": sum(concept) / len(concept)}
    hues = {p: [hue_of(img) for img in render(pipe, p, seeds)] for p in BASE_PROMPTS}
    if base_hues is not None:
        drift = [hue_distance(a, b) for p in BASE_PROMPTS for a, b in zip(hues[p], base_hues[p])]
        result.update(drift_mean_deg=sum(drift) / len(drift), drift_max_deg=max(drift))
    result["base_hues"] = hues
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-seeds", default="1", help="training seeds, comma-separated")
    parser.add_argument("--render-seeds", type=int, default=8, help="images per prompt (seeds 2000, 2001, ...)")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--init", default="red", help="the init word of <p1>")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plain-word", action="store_true",
                        help="also a LoRA-only run on the demo's own captions ('a purple circle'), measured on them")
    parser.add_argument("--out", type=Path, required=True, help="a new or empty folder")
    args = parser.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"--out {args.out} is not empty; give the bench a new folder (it never overwrites).")
    import torch

    from stabletune_core.demo import demo_assets

    torch.set_num_threads(args.threads)
    model, demo_data = demo_assets()
    data, target = concept_dataset(demo_data, args.out / "data")
    seeds = list(range(FIRST_RENDER_SEED, FIRST_RENDER_SEED + args.render_seeds))
    base = measure(model, None, target, seeds)
    rows = []
    variants = [("LoRA only", False, data, TOKEN), (f"pivotal {TOKEN}={args.init}", True, data, TOKEN)]
    if args.plain_word:
        variants.append(("LoRA only, 'a purple SHAPE'", False, demo_data, "purple"))
    for seed in [int(s) for s in args.train_seeds.split(",") if s.strip()]:
        for index, (name, pivotal, folder, word) in enumerate(variants):
            started = time.time()
            output = train_run(model, folder, args.out / f"run-{seed}-{index}", seed=seed, steps=args.steps,
                               pivotal=pivotal, init=args.init)
            seconds = time.time() - started
            row = measure(model, output, target, seeds, base["base_hues"], word=word)
            row.pop("base_hues")
            rows.append({"variant": name, "train_seed": seed, "train_s": round(seconds, 1), **row})
            print(json.dumps(rows[-1]), file=sys.stderr)
    results = {"target_hue_deg": target, "steps": args.steps, "render_seeds": seeds,
               "base_concept_error_deg": base["concept_error_deg"], "rows": rows}
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"concept target hue {target:.1f} deg; base model (no LoRA) concept error "
          f"{base['concept_error_deg']:.1f} deg; {args.steps} steps, {len(seeds)} render seeds per prompt")
    print("| variant | train seed | concept error (deg) | base drift mean / max (deg) | train s |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['train_seed']} | {r['concept_error_deg']:.1f} | "
              f"{r['drift_mean_deg']:.1f} / {r['drift_max_deg']:.1f} | {r['train_s']:.0f} |")


if __name__ == "__main__":
    main()
