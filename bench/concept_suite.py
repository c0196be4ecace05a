"""The concept suite (issue 35.1): does the demo's recipe learn concepts it was not tuned on, and keep the rest?

Six colours the toy base never saw, spread around the hue circle (orange, lime, teal, blue and magenta sit between
two colours it knows; purple is the demo's), and three shapes it never drew (the ring, which its VAE saw; a cross and
a wedge, a triangle on its apex, which nothing saw). Each concept has its own 12 images drawn by the toy world
(world.py: a colour in the three base shapes, a shape in the four base colours) beside the base's own prior images
(the demo's: 2 renders of each base prompt, demo.prior_prompts_and_seeds), and trains with the demo's preset for its
kind (presets/demo.toml for a colour, presets/demo-shape.toml for a shape) at each training seed, with no validation
images (sampling never changes the training). Each LoRA is loaded into a fresh toy pipeline and measured over the
render seeds (toy/evaluate.SCORE_SEEDS, 8 per prompt) as the demo's 8-seed measure measures it:
- concept: a colour's hue error in degrees against its own training images (before -> after), or the fraction of a
  shape's prompts' images drawn as that shape;
- each kept colour's drift in degrees against the base's own image at the same prompt and seed;
- the base prompts' shapes drawn right;
and beside them the concept's codec floor: the same concept measure on its own training images after a VAE
encode-decode round trip (no LoRA on the denoiser can do better than the codec draws).

    STABLETUNE_CACHE=/tmp/cs/cache OMP_NUM_THREADS=1 python bench/concept_suite.py --out /tmp/cs
    python bench/concept_suite.py --out /tmp/cs --concepts blue,orange --seeds 1      # a slice
    python bench/concept_suite.py --out /tmp/cs-f3 --weights /path/to/candidate --prior 4 --set learning_rate=2e-3

`--weights` measures a candidate toy base (a folder as `python -m stabletune_core.toy build` writes it) instead of
the shipped one; `--prior` sets the base's prior images per prompt and `--set KEY=VALUE` (a TOML value, repeatable)
changes the preset's recipe: a recipe is judged over the suite, never on one concept. Rows record the recipe and
base they measured, so one OUT may hold several.

Writes OUT/rows.jsonl (one line per concept x seed, reused by a later run of the same OUT) and OUT/table.md, the
markdown table for bench/RESULTS.md, and prints it. The codec floor around the whole hue circle: bench/codec_floor.py.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from stabletune_core.toy.codec import rgb_of_hue  # noqa: E402
from stabletune_core.toy.world import (BASE_COLORS, CONCEPT_COLOR, CONCEPT_RGB, SHAPES, Scene,  # noqa: E402
                                       base_prompts)

IMAGES = 12  # of each concept, as the demo's


#: name -> RGB. The base's hues: red 0, yellow 52, green 127, cyan 185 (and purple 274, never seen by its denoiser).
SUITE_COLORS: dict[str, tuple[int, int, int]] = {
    "orange": rgb_of_hue(28), "lime": rgb_of_hue(90), "teal": rgb_of_hue(157), "blue": rgb_of_hue(226),
    CONCEPT_COLOR: CONCEPT_RGB, "magenta": rgb_of_hue(318)}
SUITE_SHAPES = ("ring", "cross", "wedge")
COLUMNS = ("concept", "kind", "seed", "steps", "codec floor", "before", "after", "drift red", "drift yellow",
           "drift green", "drift cyan", "base shapes", "pass")


@dataclass(frozen=True)
class Concept:
    name: str

    @property
    def kind(self) -> str:
        return "colour" if self.name in SUITE_COLORS else "shape"

    def scenes(self) -> list[Scene]:
        """Its 12 drawn training images: a colour in every base shape, a shape in every base colour."""
        if self.kind == "colour":
            return [Scene(self.name, SHAPES[i % len(SHAPES)], 4_000_000 + i, rgb=SUITE_COLORS[self.name])
                    for i in range(IMAGES)]
        colours = list(BASE_COLORS)
        return [Scene(colours[i % len(colours)], self.name, 5_000_000 + i) for i in range(IMAGES)]

    def prompts(self) -> list[str]:
        if self.kind == "colour":
            return [f"a {self.name} {shape}" for shape in SHAPES]
        return [f"a {color} {self.name}" for color in BASE_COLORS]

    def prototypes(self) -> dict[str, tuple[float, ...]]:
        """The shapes an image may be judged as: the toy world's four, and this concept's shape."""
        from stabletune_core.toy.score import SHAPE_PROTOTYPES, UNSEEN_SHAPE_PROTOTYPES

        return {**SHAPE_PROTOTYPES, **{k: v for k, v in UNSEEN_SHAPE_PROTOTYPES.items() if k == self.name}}


def concept_measure(concept: Concept, images: list, reference: float) -> float:
    """A colour's mean hue error in degrees against `reference`, or the fraction of images drawn as the shape."""
    from stabletune_core.toy.evaluate import mean
    from stabletune_core.toy.score import hue_distance, judge

    if concept.kind == "colour":
        return mean(hue_distance(judge(image).hue, reference) for image in images)
    prototypes = concept.prototypes()
    return mean(float(judge(image, prototypes).shape == concept.name) for image in images)


def codec_floor(concept: Concept, images: list, round_trip: Callable[[Any], Any]) -> float:
    """The concept measure of its own training images after `round_trip` (the VAE's encode and decode), against
    the training images' own hue: what a denoiser that drew the training images' latents exactly would score."""
    from stabletune_core.toy.score import reference_hue

    return concept_measure(concept, [round_trip(image) for image in images], reference_hue(images))


def vae_round_trip(model: Path) -> Callable[[Any], Any]:
    """PIL image -> the same image encoded (the posterior's mean) and decoded by the model's VAE."""
    from diffusers import AutoencoderKL

    from stabletune_core.toy.codec import round_trip

    return round_trip(AutoencoderKL.from_pretrained(str(model / "vae"), local_files_only=True).eval())


def passes(row: dict) -> bool:
    """Issue 35.2's targets: a colour within 8 degrees of its training images (a shape drawn right in 70 % of its
    images) and every kept colour within 3 degrees of the base."""
    from stabletune_core.toy.judge import CONCEPT_PASS_DEG, CONCEPT_SHAPE_PASS, KEPT_PASS_DEG

    concept_ok = (row["after"] <= CONCEPT_PASS_DEG if row["kind"] == "colour" else row["after"] >= CONCEPT_SHAPE_PASS)
    return concept_ok and max(row["drift"].values()) <= KEPT_PASS_DEG


def _concept_cell(row: dict, key: str) -> str:
    value = row[key]
    return f"{value:.1f} deg" if row["kind"] == "colour" else f"{value:.0%}".replace("%", " %")


def table(rows: list[dict]) -> str:
    """The markdown table: one row per concept x training seed."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [row["concept"], row["kind"], str(row["seed"]), str(row["steps"]), _concept_cell(row, "codec_floor"),
                 _concept_cell(row, "before"), _concept_cell(row, "after"),
                 *(f"{row['drift'][c]:.1f}" for c in BASE_COLORS), f"{row['base_shapes']:.0%}".replace("%", " %"),
                 "pass" if passes(row) else "no"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def prior_images(out: Path, model: Path, family: str, per_prompt: int | None = None) -> Path:
    """The base's own images of what it keeps, as the demo's (`per_prompt` renders of each base prompt, by default
    the toy base's): rendered once per OUT, base and count."""
    from stabletune_core.demo import prior_prompts_and_seeds, write_base_images
    from stabletune_core.toy.bases import TOY_BASES

    toy = TOY_BASES[family]
    per_prompt = per_prompt or toy.prior_images_per_prompt
    folder = out / ("priors" if per_prompt == toy.prior_images_per_prompt and model == toy.model()
                    else f"priors-{per_prompt}-{model.name}")
    if not (folder / "done").is_file():
        prompts, seeds = prior_prompts_and_seeds(per_prompt)
        write_base_images(model, folder, prompts, seeds, pipeline=toy.pipeline)
        (folder / "done").write_text("")
    return folder


def recipe_overrides(settings: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` pairs as preset values: VALUE is read as TOML (2e-3, true, ["a", "b"]), else a string."""
    import tomllib

    overrides = {}
    for setting in settings:
        key, sep, value = setting.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--set {setting!r} is not KEY=VALUE: write e.g. --set learning_rate=2e-3")
        try:
            overrides[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            overrides[key.strip()] = value
    return overrides


def concept_dataset(out: Path, concept: Concept, priors: Path) -> Path:
    """OUT/data/NAME: the concept's 12 drawn images (1_NAME) and a copy of the prior images (1_known_colours)."""
    from stabletune_core.toy.world import write_dataset

    data = out / "data" / (concept.name if priors.name == "priors" else f"{concept.name}-{priors.name}")
    if not data.is_dir():
        write_dataset(data / f"1_{concept.name}", concept.scenes())
        shutil.copytree(priors, data / "1_known_colours", ignore=shutil.ignore_patterns("done"))
    return data


def train_cell(out: Path, concept: Concept, seed: int, data: Path, model: Path, family: str,
               steps: int | None, overrides: dict[str, Any] | None = None, tag: str = "") -> tuple[Path, int]:
    """Train one concept x seed with the demo's preset of its kind (and `overrides` on top, in a run folder named
    with `tag`: bench/storage_quality.py's base_storage); returns (LoRA file, steps)."""
    from stabletune_core.cli import run_train
    from stabletune_core.config import build_config, read_toml
    from stabletune_core.demo import demo_preset

    values = read_toml(demo_preset(concept.kind, family))
    values.update(pretrained_model_name_or_path=str(model), train_data_dir=str(data), seed=seed,
                  output_dir=str(out / "runs" / f"{concept.name}-seed{seed}{tag}"),
                  output_name=f"{concept.name}_lora", validation_prompt=None, sample_judge="none", **(overrides or {}))
    if steps:
        values.update(max_train_steps=steps, save_steps=min(steps, values.get("save_steps", steps)))
    config = build_config(values)
    lora = Path(config.output_dir) / "output" / f"{config.output_name}.safetensors"
    if not lora.is_file() and run_train(config) != 0:
        raise SystemExit(f"the {concept.name} seed-{seed} run failed; see {config.output_dir}")
    return lora, config.max_train_steps


def measure_cell(concept: Concept, lora: Path, model: Path, base: dict, render_seeds: list[int],
                 reference: float, load_pipeline: Callable[[Path], Any]) -> dict:
    """The 8-seed measures of one LoRA against the base's renders (`base`: base and concept prompts)."""
    from stabletune_core.toy.evaluate import drift, mean, render
    from stabletune_core.toy.score import caption_parts, judge

    pipe = load_pipeline(model)
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name, adapter_name="concept")
    tuned = render(pipe, base_prompts() + concept.prompts(), render_seeds)
    moved = drift({p: base[p] for p in base_prompts()}, {p: tuned[p] for p in base_prompts()})
    prototypes = concept.prototypes()
    return {"before": round(concept_measure(concept, [i for p in concept.prompts() for i in base[p]], reference), 4),
            "after": round(concept_measure(concept, [i for p in concept.prompts() for i in tuned[p]], reference), 4),
            "drift": {c: round(mean(v for p, v in moved.items() if caption_parts(p)[0] == c), 2) for c in BASE_COLORS},
            "base_shapes": round(mean(float(judge(image, prototypes).shape == caption_parts(p)[1])
                                      for p in base_prompts() for image in tuned[p]), 4)}


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder of the suite (data, runs, rows, table).")
    parser.add_argument("--concepts", default=",".join([*SUITE_COLORS, *SUITE_SHAPES]),
                        help=f"comma-separated, from {', '.join([*SUITE_COLORS, *SUITE_SHAPES])}")
    parser.add_argument("--seeds", type=int, default=3, help="training seeds per concept: 1..N")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the preset's)")
    parser.add_argument("--render-seeds", type=int, default=8, help="render seeds per prompt, from 1000")
    parser.add_argument("--family", choices=["sd1"], default="sd1", help="the toy base (the SD 1.x one)")
    parser.add_argument("--weights", type=Path, default=None,
                        help="a candidate toy base's weights folder (default: the shipped base)")
    parser.add_argument("--prior", type=int, default=None, help="prior images per base prompt (default: the base's)")
    parser.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe change on the preset (TOML value), repeatable")
    args = parser.parse_args(argv)
    unknown = [c for c in args.concepts.split(",") if c not in (*SUITE_COLORS, *SUITE_SHAPES)]
    if unknown:
        parser.error(f"unknown concept {unknown[0]!r}: choose from {', '.join([*SUITE_COLORS, *SUITE_SHAPES])}")

    import torch

    from stabletune_core.toy import materialize
    from stabletune_core.toy.bases import TOY_BASES
    from stabletune_core.toy.evaluate import render
    from stabletune_core.toy.judge import concept_reference_in
    from stabletune_core.toy.world import draw_scene

    torch.set_num_threads(1)  # the toy model is dispatch-bound (train/threads.py)
    args.out.mkdir(parents=True, exist_ok=True)
    toy = TOY_BASES[args.family]
    overrides = recipe_overrides(args.settings)
    model = materialize(args.weights) if args.weights else toy.model()
    priors = prior_images(args.out, model, args.family, args.prior)
    recipe = {"base": model.name, "prior": args.prior or toy.prior_images_per_prompt, **overrides}
    tag = "" if recipe == {"base": toy.model().name, "prior": toy.prior_images_per_prompt} else \
        "-" + hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:8]
    render_seeds = list(range(1000, 1000 + args.render_seeds))
    concepts = [Concept(name) for name in args.concepts.split(",")]
    base = render(toy.pipeline(model), base_prompts() + [p for c in concepts for p in c.prompts()], render_seeds)
    round_trip = vae_round_trip(model)
    done = {}
    rows_file = args.out / "rows.jsonl"
    if rows_file.is_file():
        for line in rows_file.read_text().splitlines():
            row = json.loads(line)
            done[(row["concept"], row["seed"], row["steps"], row["render_seeds"],
                  json.dumps(row.get("recipe", {}), sort_keys=True))] = row
    rows = []
    for concept in concepts:
        data = concept_dataset(args.out, concept, priors)
        reference = concept_reference_in(data, concept.name) if concept.kind == "colour" else float("nan")
        floor = codec_floor(concept, [draw_scene(s) for s in concept.scenes()], round_trip)
        for seed in range(1, args.seeds + 1):
            started = time.perf_counter()
            lora, steps = train_cell(args.out, concept, seed, data, model, args.family, args.steps, overrides, tag)
            key = (concept.name, seed, steps, args.render_seeds, json.dumps(recipe, sort_keys=True))
            if key not in done:
                torch.set_num_threads(1)
                row = {"concept": concept.name, "kind": concept.kind, "seed": seed, "steps": steps,
                       "render_seeds": args.render_seeds, "recipe": recipe, "codec_floor": round(floor, 4),
                       "reference": reference,
                       **measure_cell(concept, lora, model, base, render_seeds, reference, toy.pipeline),
                       "seconds": round(time.perf_counter() - started)}
                done[key] = save_row(rows_file, row)
            rows.append(done[key])
            print(table([done[key]]).splitlines()[-1], flush=True)
    return write_table(args.out, table(rows))


def save_row(rows_file: Path, row: dict) -> dict:
    """Append one measured row to OUT/rows.jsonl (a later run of the same OUT reuses it)."""
    rows_file.parent.mkdir(parents=True, exist_ok=True)
    with open(rows_file, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    return row


def write_table(out: Path, text: str) -> str:
    """OUT/table.md, printed: the markdown for bench/RESULTS.md."""
    (out / "table.md").write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
