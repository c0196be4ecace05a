"""Quality per minute, side by side: what StableTune's defaults and diffusers' example script have learned
after the same wall-clock budgets, on the toy base.

Both trainers get the toy base (stabletune_core/toy), the demo dataset (12 purple shapes + 24 shapes in the
colours the base knows, the same images and captions), seed 7, 64 px, LoRA rank 8 and batch 4, and the same
number of CPU threads. StableTune runs `presets/demo.toml` (its defaults for this world); the peer,
diffusers' `examples/text_to_image/train_text_to_image_lora.py`, runs with its own defaults except those
(learning rate: 1e-4 as its README recommends for LoRA, and a second row at 1e-3, StableTune's UNet rate).

How the budgets are measured: each trainer runs once, as its own process, for the largest budget, and saves
a snapshot every `--snapshot_steps` steps (StableTune: `save_steps`, its checkpoints; the peer:
`--checkpointing_steps`, whose accelerate states hold a `pytorch_lora_weights.safetensors`). A snapshot
belongs to a budget when its last file was written within that many seconds of the process start, so
start-up (imports, model load, dataset preparation, StableTune's first validation images) and the time spent
writing snapshots count against each trainer. After the runs, each budget's snapshot is loaded into a fresh
toy pipeline with diffusers' `load_lora_weights` (StableTune's checkpoints are first exported to its
kohya-format LoRA with `python -m stabletune_core export`) and measured by the toy world's judge over 8
seeds: the concept's hue error in degrees (purple prompts' images against the hue of the purple training
images), the worst base colour's drift in degrees (the base prompts' images against the base model's own
image at the same prompt and seed) and the base shapes right in percent.

    python bench/toy_quality.py --peer-script /tmp/peer/train_text_to_image_lora.py \\
        --peer-pythonpath /tmp/peerlib --budgets 1,2,4 --threads 2 --out /tmp/toy-quality

The peer script is never committed here; `--peer-pythonpath` is a folder with what it needs that StableTune
does not ship (`datasets` and its pyarrow, dill, xxhash, multiprocess).

`--family flux2_klein` (issue 23 item 6) does the same on the toy FLUX.2 Klein base (stabletune_core/toy/klein.py)
with its demo preset (`presets/demo-flux2-klein.toml`, or `--preset`) against diffusers'
`examples/dreambooth/train_dreambooth_lora_flux2_klein.py`, which reads the captions from the same images as an
imagefolder (`--dataset_name DIR --caption_column text`). Its two rows:
- its README's Klein recipe: lr 1e-4, constant, 500 steps, and its defaults otherwise (rank 4 = alpha, batch 4:
  the README's batch 1 x 4 accumulation is the same batch of 4, split for a 4B's memory);
- the same with StableTune's learning rate, rank, alpha and batch (from the preset).
Both get what the toy base itself needs and the example cannot know: the preset's text length
(`--max_sequence_length 32`, the length the toy Klein was built and is sampled at; the example's 512 trains on other
text embeddings than the pipeline renders with) and `--text_encoder_out_layers 9 18 27` (the layers
Flux2KleinPipeline reads; the example's 10 20 30 are not, see bench/transformer_peer.py). Each LoRA is scored through
the toy Klein's Flux2KleinPipeline with `load_lora_weights`, by the same judge.

    python bench/toy_quality.py --family flux2_klein \\
        --peer-script /tmp/peer-klein/train_dreambooth_lora_flux2_klein.py \\
        --peer-pythonpath /tmp/peerlib --budgets 0.5,1,2,4 --threads 2 --out /tmp/klein-quality

`--concepts orange,teal,blue,magenta` (issue 35 item 6, sd1 only) runs the same rows on the concept suite
(bench/concept_suite.py) instead of the demo's purple alone: for each suite colour, every trainer trains on that
concept's suite dataset (its 12 drawn images and the base's prior images, concept_suite.concept_dataset), StableTune
with the preset as `demo --concept-word NAME` runs it (its validation prompts name the concept), and each budget's
snapshot is measured as the suite measures a LoRA (concept_suite.measure_cell over `--render-seeds` seeds: the
concept's hue error against its training images, each kept colour's drift, the base shapes) and judged by issue
35.2's targets (concept_suite.passes). The report adds, per trainer and budget, the share of concept cells that pass
and the mean concept error and mean worst drift over the concepts. Without `--concepts`: the demo's purple, as above.

    python bench/toy_quality.py --peer-script /tmp/peer/train_text_to_image_lora.py --peer-pythonpath /tmp/peerlib \\
        --concepts orange,teal,blue,magenta --budgets 1,2 --threads 1 --render-seeds 8 --out /tmp/qpm
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "bench"))

import transformer_example  # noqa: E402  (the examples' commands; bench/transformer_peer.py times the same ones)

PRESET = ROOT / "presets" / "demo.toml"
SCORE_SEEDS_PER_PROMPT = 8  # seeds 1000..1007, as tests/test_toy_learning.py measures the demo's LoRA
PEER_LEARNING_RATES = (1e-4, 1e-3)
STOP_GRACE_S = 30
FAMILIES = ("sd1", "flux2_klein")
#: The diffusers example each family is compared with (the peer script is never committed).
PEER_SCRIPTS = {"sd1": "examples/text_to_image/train_text_to_image_lora.py",
                "flux2_klein": "examples/dreambooth/train_dreambooth_lora_flux2_klein.py"}
#: The Klein example's README recipe (examples/dreambooth/README_flux2.md, "FLUX 2 [klein] 4B"): lr 1e-4, constant,
#: 500 steps; rank (4, alpha 4) and batch (4) are the script's defaults.
KLEIN_README = {"learning_rate": 1e-4, "steps": 500, "rank": 4, "alpha": 4, "batch": 4}


# ------------------------------------------------------------------------------------------------- data
def dataset_images(dataset: Path) -> list[tuple[Path, str]]:
    """(image, caption) for every image of a StableTune dataset folder (captions in same-name .txt files)."""
    images = sorted(p for p in Path(dataset).rglob("*.png"))
    return [(p, p.with_suffix(".txt").read_text(encoding="utf-8").strip()) for p in images]


def write_imagefolder(images: list[tuple[Path, str]], target: Path) -> Path:
    """The same images and captions as a 🤗 datasets imagefolder: the files, flat, and a metadata.jsonl of
    {"file_name", "text"}. Each name keeps its sub-folder (e.g. `1_purple__purple_circle_000.png`), so the
    concept images and the prior images cannot collide. Refuses a folder that is not empty."""
    target = Path(target)
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} is not empty; give the bench a new --out folder.")
    target.mkdir(parents=True, exist_ok=True)
    lines = []
    for path, caption in images:
        name = f"{path.parent.name}__{path.name}"
        (target / name).write_bytes(path.read_bytes())
        lines.append(json.dumps({"file_name": name, "text": caption}))
    (target / "metadata.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return target


# ---------------------------------------------------------------------------------------------- budgets
@dataclass(frozen=True)
class Snapshot:
    step: int
    seconds: float  # from the trainer's process start to the snapshot's last written file
    path: Path


def parse_budgets(text: str) -> list[float]:
    """'1,2,4' -> [1.0, 2.0, 4.0] minutes, sorted; a clear sentence for anything else."""
    try:
        budgets = sorted(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise SystemExit(f"--budgets {text!r} is not a comma-separated list of minutes, e.g. 1,2,4.") from None
    if not budgets or budgets[0] <= 0:
        raise SystemExit(f"--budgets {text!r} needs at least one budget, each above 0 minutes.")
    return budgets


def snapshot_within(snapshots: list[Snapshot], budget_s: float) -> Snapshot | None:
    """The furthest snapshot written within `budget_s` seconds of the start, or None if none was."""
    inside = [s for s in snapshots if s.seconds <= budget_s]
    return max(inside, key=lambda s: s.step) if inside else None


def written_at(folder: Path) -> float:
    """When the last file of a snapshot folder was written (its mtime)."""
    return max(p.stat().st_mtime for p in Path(folder).rglob("*") if p.is_file())


def snapshots(parent: Path, pattern: str, started: float) -> list[Snapshot]:
    """The snapshot folders under `parent` whose name matches `pattern` (one group: the step)."""
    found = []
    for folder in Path(parent).glob("*"):
        match = re.fullmatch(pattern, folder.name)
        if match and folder.is_dir() and any(folder.iterdir()):
            found.append(Snapshot(int(match.group(1)), written_at(folder) - started, folder))
    return sorted(found, key=lambda s: s.step)


# ----------------------------------------------------------------------------------------------- launch
def thread_env(threads: int, pythonpath: str | None = None) -> dict[str, str]:
    """The same thread count for every trainer, offline, and the peer's extra site folder if any."""
    paths = [str(ROOT)] + ([pythonpath] if pythonpath else [])
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(paths)}


def default_preset(family: str) -> Path:
    """The family's demo preset (the one `python -m stabletune_core demo --family FAMILY` runs)."""
    from stabletune_core.toy.bases import TOY_BASES

    return ROOT / "presets" / TOY_BASES[family].preset


def stabletune_command(model: Path, data: Path, run_dir: Path, snapshot_steps: int,
                       preset: Path = PRESET) -> list[str]:
    """StableTune's demo preset as it ships; only where and how often it saves are the bench's."""
    return [sys.executable, "-m", "stabletune_core", "train", "--config", str(preset),
            "--pretrained_model_name_or_path", str(model), "--train_data_dir", str(data),
            "--output_dir", str(run_dir), "--save_steps", str(snapshot_steps),
            "--checkpoints_total_limit", "100000"]


#: What a preset samples while it trains (validation images and the judge reading them): the example samples nothing.
SAMPLING_KNOBS = ("validation_prompt", "sample_judge")


def preset_without_samples(preset: Path, target: Path) -> Path:
    """`preset` without its validation images, written to `target`: the same training as the example does it,
    sampling nothing, so that a row shows what StableTune's training alone reaches per minute."""
    import tomli_w

    from stabletune_core.config import read_toml

    values = {k: v for k, v in read_toml(preset).items() if k not in SAMPLING_KNOBS}
    target.write_text(tomli_w.dumps(values), encoding="utf-8")
    return target


def peer_command(script: Path, model: Path, data: Path, out: Path, learning_rate: float, snapshot_steps: int,
                 preset: dict) -> list[str]:
    """The diffusers example with its own defaults, except what must match StableTune's run."""
    return [sys.executable, str(script), "--pretrained_model_name_or_path", str(model),
            "--train_data_dir", str(data), "--output_dir", str(out), "--cache_dir", str(out / "hf-cache"),
            "--resolution", str(preset["resolution"]), "--rank", str(preset["lora_rank"]),
            "--seed", str(preset["seed"]), "--train_batch_size", str(preset["train_batch_size"]),
            "--learning_rate", str(learning_rate), "--checkpointing_steps", str(snapshot_steps)]


def klein_example_command(script: Path, model: Path, data: Path, out: Path, snapshot_steps: int, preset: dict,
                          recipe: dict) -> list[str]:
    """diffusers' Klein example on the toy Klein: `recipe`'s learning rate, steps, rank, alpha and batch; the
    preset's resolution, seed and text length (none set: the example's 512, StableTune's default too); the
    pipeline's text layers; a snapshot every `snapshot_steps`."""
    setting = transformer_example.Setting(steps=recipe["steps"], rank=recipe["rank"], alpha=recipe["alpha"],
                                    learning_rate=recipe["learning_rate"], batch=recipe["batch"],
                                    resolution=preset["resolution"], seed=preset["seed"])
    return [sys.executable] + transformer_example.peer_command(script, model, data, out, setting,
                                                         snapshot_steps=snapshot_steps,
                                                         text_length=preset.get("max_sequence_length"))


def peer_rows(family: str, preset: dict) -> list[tuple[str, dict]]:
    """(row name, what the row sets) for each run of the family's diffusers example. sd1: the example's defaults
    but rank and batch at the preset's, at its README's LoRA lr (1e-4) and at 1e-3; flux2_klein: its README recipe
    (KLEIN_README), and the same at the preset's learning rate, rank, alpha and batch."""
    if family == "sd1":
        return [(f"diffusers example, lr {lr:g}", {"learning_rate": lr}) for lr in PEER_LEARNING_RATES]
    alpha = preset.get("lora_alpha") or preset["lora_rank"]  # StableTune's empty alpha is the rank
    if alpha != int(alpha):
        raise SystemExit(f"The preset's lora_alpha {alpha} is not a whole number; the Klein example's --lora_alpha "
                         "takes only whole numbers.")
    ours = {"learning_rate": preset["learning_rate"], "rank": preset["lora_rank"], "alpha": int(alpha),
            "batch": preset["train_batch_size"]}
    return [(f"diffusers example, its README (lr {KLEIN_README['learning_rate']:g}, rank {KLEIN_README['rank']})",
             dict(KLEIN_README)),
            (f"diffusers example, StableTune's lr {ours['learning_rate']:g}, rank {ours['rank']}, batch "
             f"{ours['batch']}", {**KLEIN_README, **ours})]


def family_peer_command(family: str, script: Path, model: Path, data: Path, out: Path, snapshot_steps: int,
                        preset: dict, row: dict) -> list[str]:
    """The peer command of one of `peer_rows`' rows."""
    if family == "sd1":
        return peer_command(script, model, data, out, row["learning_rate"], snapshot_steps, preset)
    return klein_example_command(script, model, data, out, snapshot_steps, preset, row)


def run_for(command: list[str], env: dict[str, str], seconds: float, log: Path) -> float:
    """Run `command` until it ends or `seconds` have passed (then stop it); returns its start time."""
    with open(log, "w") as out:
        started = time.time()
        process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    return started


# ------------------------------------------------------------------------------------------------ score
def stabletune_lora(checkpoint: Path, env: dict[str, str]) -> Path:
    """StableTune's checkpoint as its kohya-format LoRA file (what a user loads), via its own export."""
    name = f"bench_{checkpoint.name}"
    target = checkpoint.parent.parent / "output" / f"{name}.safetensors"
    if not target.is_file():
        subprocess.run([sys.executable, "-m", "stabletune_core", "export", str(checkpoint), "--name", name],
                       env=env, cwd=ROOT, check=True, capture_output=True)
    return target


def peer_lora(checkpoint: Path) -> Path:
    """The LoRA the peer's save hook wrote into its accelerate checkpoint."""
    return checkpoint / "pytorch_lora_weights.safetensors"


def score(model: Path, lora: Path | None, data: Path, base_images: dict | None = None, family: str = "sd1",
          seeds_per_prompt: int = SCORE_SEEDS_PER_PROMPT) -> dict:
    """The family's toy base with `lora` (None: the base alone), in a fresh pipeline (the toy judge's: sd1's
    StableDiffusionPipeline, flux2_klein's Flux2KleinPipeline at the toy's text length), measured in degrees over
    `seeds_per_prompt` seeds (1000, 1001, ...): the concept prompts' hue error against the concept's training images in
    `data`, and the base prompts' drift against `base_images` (the base's own renders, same prompts and seeds;
    None: this is the base, drift 0). Returns the measures and, under "images", every prompt's renders."""
    import diffusers
    import transformers

    from stabletune_core.toy.bases import TOY_BASES
    from stabletune_core.toy.evaluate import learning_report, render
    from stabletune_core.toy.judge import concept_reference_in
    from stabletune_core.toy.world import CONCEPT_COLOR, base_prompts, concept_prompts

    for library in (diffusers, transformers):  # a line per loaded LoRA would bury the table
        library.utils.logging.set_verbosity_error()
        library.utils.logging.disable_progress_bar()
    pipe = TOY_BASES[family].pipeline(model)
    if lora is not None:
        pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    seeds = list(range(1000, 1000 + seeds_per_prompt))
    images = render(pipe, base_prompts() + concept_prompts(), seeds)
    # the measures tests/test_toy_klein.py and bench/klein_demo_trials.py take (the worst colour's drift here)
    report = learning_report(base_images or images, images, concept_reference_in(data, CONCEPT_COLOR))
    return {"concept_error": report["concept_after"], "worst_drift": max(report["drift"].values()),
            "shapes": report["shapes"], "images": images}


# ----------------------------------------------------------------------------------------------- report
def markdown_table(rows: list[dict], budgets: list[float]) -> str:
    """One line per trainer and budget: steps reached, concept hue error, worst base drift, base shapes."""
    lines = ["| trainer | budget | load avg at start / end of its run | steps | concept hue error (deg) | worst "
             "base colour drift (deg) | base shapes % |", "|---|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        load = f"{row['load']:.2f}" + (f" / {row['load_end']:.2f}" if "load_end" in row else "")
        for budget, cell in zip(budgets, row["budgets"]):
            if cell is None:
                lines.append(f"| {row['name']} | {budget:g} min | {load} | 0 | (no snapshot yet) | | |")
            else:
                lines.append(f"| {row['name']} | {budget:g} min | {load} | {cell['step']} | "
                             f"{cell['concept_error']:.1f} | {cell['worst_drift']:.1f} | {cell['shapes'] * 100:.0f} |")
    return "\n".join(lines)


def run_summary(row: dict) -> str:
    """When a trainer's first and last snapshots were written: start-up cost and pace, in one line."""
    found = row["snapshots"]
    if not found:
        return f"{row['name']}: no snapshot written"
    (first_step, first_s), (last_step, last_s) = found[0], found[-1]
    pace = (last_s - first_s) / (last_step - first_step) if last_step > first_step else float("nan")
    return (f"{row['name']}: step {first_step} written at {first_s:.0f} s, last snapshot step {last_step} at "
            f"{last_s:.0f} s ({pace:.3f} s/step in between, snapshots and validation included)")


def scoring_order(rows: list[dict], budget_count: int) -> list[tuple[int, dict]]:
    """(budget index, row) of every cell with a snapshot, the longest budget first and across rows: on a busy
    machine, where scoring takes longer than training, a run stopped while scoring has the comparable cells."""
    return [(b, row) for b in reversed(range(budget_count)) for row in rows if row["chosen"][b] is not None]


def write_results(path: Path, results: dict) -> None:
    """results.json without what only the run needs (each row's environment and chosen snapshot objects)."""
    plain = {**results, "rows": [{k: v for k, v in row.items() if k not in ("env", "chosen")}
                                 for row in results["rows"]]}
    path.write_text(json.dumps(plain, indent=1))


def check_peer(args: argparse.Namespace) -> None:
    """The peer script and its `datasets` package are there: one sentence before any model loads."""
    if args.peer_script is None or not args.peer_script.is_file():
        raise SystemExit(f"--peer-script {args.peer_script} is not a file; give the path of diffusers' "
                         f"{PEER_SCRIPTS[getattr(args, 'family', 'sd1')]}.")
    found = subprocess.run([sys.executable, "-c", "import datasets"], env=thread_env(1, args.peer_pythonpath),
                           capture_output=True)
    if found.returncode:
        raise SystemExit("The peer script needs the `datasets` package; install it into a folder of its own "
                         "(pip install --no-deps --target DIR datasets pyarrow dill xxhash multiprocess) and "
                         "pass --peer-pythonpath DIR.")


# ------------------------------------------------------------------------------------ the concept suite
def parse_concepts(text: str | None) -> list[str] | None:
    """'orange,teal' -> ['orange', 'teal'] (suite colours, in the order given); None or '' -> None (the demo's
    purple alone); one sentence for a name that is not a suite colour."""
    from concept_suite import SUITE_COLORS, SUITE_SHAPES

    if not text:
        return None
    names = [part.strip() for part in text.split(",") if part.strip()]
    for name in names:
        if name not in SUITE_COLORS:
            why = " (a shape: the suite trains it with another preset, which the example has no row for)" \
                if name in SUITE_SHAPES else ""
            raise SystemExit(f"--concepts: {name!r} is not a suite colour{why}; choose from {', '.join(SUITE_COLORS)}.")
    if len(set(names)) != len(names):
        raise SystemExit(f"--concepts {text!r} names a colour twice; name each once.")
    return names


def concept_preset(preset: Path, concept: str, target: Path) -> Path:
    """`preset` as `demo --concept-word CONCEPT` trains it, written to `target`: its validation prompts name the
    concept instead of purple (the same prompts for purple); a preset that samples nothing is copied as it is."""
    import tomli_w

    from stabletune_core.config import read_toml
    from stabletune_core.demo import word_validation_prompts

    values = read_toml(preset)
    if values.get("validation_prompt"):
        values["validation_prompt"] = word_validation_prompts(values["validation_prompt"], concept)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(tomli_w.dumps(values), encoding="utf-8")
    return target


def suite_cell(trainer: str, concept: str, budget: float, snap: Snapshot, measured: dict) -> dict:
    """One trainer x concept x budget, measured as concept_suite measures a LoRA, with its pass verdict (35.2)."""
    from concept_suite import passes

    row = {"trainer": trainer, "concept": concept, "kind": "colour", "budget_min": budget, "step": snap.step,
           "seconds": round(snap.seconds, 1), **measured}
    return {**row, "pass": passes(row)}


def suite_summary(cells: list[dict], trainers: list[str], concepts: list[str], budgets: list[float]) -> list[dict]:
    """Per trainer and budget, over the concepts: the share of concept cells that pass (a concept with no
    snapshot within the budget counts as not passing), and the mean concept error and mean worst kept-colour drift
    over the cells measured."""
    summary = []
    for trainer in trainers:
        for budget in budgets:
            mine = [c for c in cells if c["trainer"] == trainer and c["budget_min"] == budget]
            worst = [max(c["drift"].values()) for c in mine]
            summary.append({"trainer": trainer, "budget_min": budget, "measured": len(mine),
                            "passed": sum(c["pass"] for c in mine), "concepts": len(concepts),
                            "pass_share": sum(c["pass"] for c in mine) / len(concepts),
                            "mean_concept_error": sum(c["after"] for c in mine) / len(mine) if mine else None,
                            "mean_worst_drift": sum(worst) / len(worst) if worst else None})
    return summary


def suite_tables(cells: list[dict], summary: list[dict]) -> str:
    """The markdown of a suite run: the pass share per trainer and budget, then every measured cell."""
    lines = ["| trainer | budget | concept cells that pass | mean concept hue error (deg) | mean worst kept-colour "
             "drift (deg) |", "|---|---:|---:|---:|---:|"]
    for s in summary:
        error = "" if s["mean_concept_error"] is None else f"{s['mean_concept_error']:.1f}"
        drift = "" if s["mean_worst_drift"] is None else f"{s['mean_worst_drift']:.1f}"
        seen = "" if s["measured"] == s["concepts"] else f" ({s['measured']} measured)"
        lines.append(f"| {s['trainer']} | {s['budget_min']:g} min | {s['passed']}/{s['concepts']} "
                     f"({s['pass_share']:.0%}){seen} | {error} | {drift} |")
    lines += ["", "| trainer | concept | budget | steps | hue error (deg) | drift red / yellow / green / cyan (deg) | "
              "base shapes % | pass |", "|---|---|---:|---:|---:|---|---:|---|"]
    for c in cells:
        drifts = " / ".join(f"{v:.1f}" for v in c["drift"].values())
        lines.append(f"| {c['trainer']} | {c['concept']} | {c['budget_min']:g} min | {c['step']} | {c['after']:.1f} | "
                     f"{drifts} | {c['base_shapes'] * 100:.0f} | {'pass' if c['pass'] else 'no'} |")
    return "\n".join(lines)


def suite_trainers(args: argparse.Namespace, preset: dict, concept: str) -> list[tuple[str, str, object]]:
    """(row name, kind, StableTune's preset or the peer's row) for one suite concept: StableTune's preset with
    validation prompts naming the concept, then the example's rows (none with --stabletune-only)."""
    shown = args.preset.relative_to(ROOT) if args.preset.is_relative_to(ROOT) else args.preset
    own = concept_preset(args.preset, concept, args.out / concept / "preset.toml")
    trainers = [(f"StableTune ({shown})", "stabletune", own)]
    if not args.stabletune_only:
        trainers += [(name, "peer", row) for name, row in peer_rows(args.family, preset)]
    return trainers


def run_suite(args: argparse.Namespace, budgets: list[float], preset: dict) -> None:
    """--concepts: every trainer on each concept's suite dataset, each budget's snapshot measured by the suite."""
    import torch

    from concept_suite import Concept, concept_dataset, measure_cell, prior_images
    from stabletune_core.toy.bases import TOY_BASES
    from stabletune_core.toy.evaluate import render
    from stabletune_core.toy.judge import concept_reference_in
    from stabletune_core.toy.world import base_prompts

    toy = TOY_BASES[args.family]
    model = toy.model()
    priors = prior_images(args.out, model, args.family)
    concepts = [Concept(name) for name in args.concepts]
    runs = []  # (concept, its training data, its trainers' rows)
    for concept in concepts:
        data = concept_dataset(args.out, concept, priors)
        peer_data = write_imagefolder(dataset_images(data), args.out / concept.name / "peer-data")
        trainers = suite_trainers(args, preset, concept.name)
        runs.append((concept, data, train_rows(args, trainers, budgets, model, data, peer_data,
                                               args.out / concept.name, preset)))

    print("Scoring (fresh toy pipeline per LoRA, the suite's measures) ...", file=sys.stderr)
    torch.set_num_threads(args.threads)
    render_seeds = list(range(1000, 1000 + args.score_seeds))
    base = render(toy.pipeline(model), base_prompts() + [p for c in concepts for p in c.prompts()], render_seeds)
    names = [row["name"] for row in runs[0][2]]
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
               "family": args.family, "preset": str(args.preset), "threads": args.threads,
               "render_seeds_per_prompt": args.score_seeds, "budgets_min": budgets, "concepts": args.concepts,
               "snapshot_steps": args.snapshot_steps, "complete": False, "cells": [],
               "runs": {c.name: rows for c, _, rows in runs}}
    for _, _, rows in runs:
        for row in rows:
            row["budgets"] = [None] * len(budgets)
    references = {c.name: concept_reference_in(data, c.name) for c, data, _ in runs}
    measures: dict[Path, dict] = {}  # a run that ended early offers one snapshot to several budgets
    # the longest budget first over every concept: a run stopped while scoring has that budget's whole share
    order = [(b, concept, row) for b in reversed(range(len(budgets))) for concept, _, rows in runs for row in rows
             if row["chosen"][b] is not None]
    for b, concept, row in order:
        snap = row["chosen"][b]
        if snap.path not in measures:
            lora = stabletune_lora(snap.path, row["env"]) if row["kind"] == "stabletune" else peer_lora(snap.path)
            measures[snap.path] = measure_cell(concept, lora, model, base, render_seeds, references[concept.name],
                                               toy.pipeline)
        cell = suite_cell(row["name"], concept.name, budgets[b], snap, measures[snap.path])
        row["budgets"][b] = cell
        results["cells"].append(cell)
        results["summary"] = suite_summary(results["cells"], names, args.concepts, budgets)
        print(f"{row['name']}, {concept.name}, {budgets[b]:g} min, step {snap.step}: {cell}", file=sys.stderr)
        write_suite_results(args.out / "results.json", results)  # a run stopped while scoring keeps what it scored
    results["summary"] = suite_summary(results["cells"], names, args.concepts, budgets)
    results["cells"].sort(key=lambda c: (names.index(c["trainer"]), args.concepts.index(c["concept"]),
                                         c["budget_min"]))
    results["complete"] = True
    write_suite_results(args.out / "results.json", results)
    text = suite_tables(results["cells"], results["summary"])
    (args.out / "table.md").write_text(text + "\n", encoding="utf-8")
    print(f"\nThe concept suite on the toy {args.family} base: {', '.join(args.concepts)}; {args.threads} threads, "
          f"snapshots every {args.snapshot_steps} steps, {args.score_seeds} render seeds per prompt, {results['date']}")
    print(text)
    for concept, _, rows in runs:
        for row in rows:
            print(f"{concept.name}: {run_summary(row)} (load {row['load']:.2f} / {row['load_end']:.2f})")
    print(f"\nRuns, logs, results.json and table.md: {args.out}")


def write_suite_results(path: Path, results: dict) -> None:
    """results.json of a suite run, each concept's rows without what only the run needs."""
    plain = {**results, "runs": {name: [{k: v for k, v in row.items() if k not in ("env", "chosen", "budgets")}
                                        for row in rows] for name, rows in results["runs"].items()}}
    path.write_text(json.dumps(plain, indent=1))


# ------------------------------------------------------------------------------------------------- main
def train_rows(args: argparse.Namespace, trainers: list[tuple[str, str, object]], budgets: list[float], model: Path,
               data: Path, peer_data: Path, folder: Path, preset: dict) -> list[dict]:
    """Each trainer, one after the other, for the largest budget (or until it ends); its snapshots and the one
    each budget takes. Runs and logs under `folder`."""
    limit = budgets[-1] * 60
    rows = []
    for index, (name, kind, what) in enumerate(trainers):  # what: StableTune's preset, or the peer's row
        run_dir = folder / f"run-{index}-{kind}"
        load = os.getloadavg()[0]
        print(f"{name}: running for {limit / 60:g} min (load average {load:.2f})", file=sys.stderr)
        if kind == "stabletune":
            env = thread_env(args.threads)
            command = stabletune_command(model, data, run_dir, args.snapshot_steps, what) + max_steps(args)
            started = run_for(command, env, limit, folder / f"run-{index}.log")
            found = snapshots(run_dir / "checkpoints", r"step_(\d+)", started)
        else:
            env = thread_env(args.threads, args.peer_pythonpath)
            command = family_peer_command(args.family, args.peer_script, model, peer_data, run_dir,
                                          args.snapshot_steps, preset, what) + max_steps(args)
            started = run_for(command, env, limit, folder / f"run-{index}.log")
            found = snapshots(run_dir, r"checkpoint-(\d+)", started)
        rows.append({"name": name, "kind": kind, "load": load, "load_end": os.getloadavg()[0], "env": env,
                     "started_utc": datetime.datetime.fromtimestamp(started, datetime.timezone.utc).isoformat(
                         timespec="seconds"), "command": command,
                     "snapshots": [(s.step, round(s.seconds, 1)) for s in found],
                     "chosen": [snapshot_within(found, b * 60) for b in budgets]})
    return rows


def max_steps(args: argparse.Namespace) -> list[str]:
    """--max-steps N as both trainers' own flag (a quick slice); nothing when unset (each trainer's own length)."""
    return ["--max_train_steps", str(args.max_steps)] if args.max_steps else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=FAMILIES, default="sd1",
                        help="which toy base: sd1 (the toy SD 1.x) or flux2_klein (the toy FLUX.2 Klein)")
    parser.add_argument("--preset", type=Path, default=None,
                        help="StableTune's preset (default: the family's demo preset, presets/demo.toml or "
                             "presets/demo-flux2-klein.toml)")
    parser.add_argument("--peer-script", type=Path, default=None,
                        help="the family's diffusers example (never committed): sd1 "
                             f"{PEER_SCRIPTS['sd1']}, flux2_klein {PEER_SCRIPTS['flux2_klein']}")
    parser.add_argument("--peer-pythonpath", default=None, help="extra site folder for the peer (datasets)")
    parser.add_argument("--budgets", default="1,2,4", help="wall-clock budgets in minutes, comma-separated")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of every trainer and of the scoring")
    parser.add_argument("--snapshot-steps", type=int, default=10, help="steps between two saved LoRAs")
    parser.add_argument("--score-seeds", "--render-seeds", dest="score_seeds", type=int,
                        default=SCORE_SEEDS_PER_PROMPT,
                        help="render seeds per prompt of each score, from 1000 (fewer: a quicker, noisier score; say "
                             "so with the numbers); --render-seeds as bench/concept_suite.py names it")
    parser.add_argument("--without-samples-row", action="store_true",
                        help="a second StableTune row: the preset without its validation images (the example samples "
                             "nothing while it trains)")
    parser.add_argument("--concepts", default=None,
                        help="suite colours (bench/concept_suite.py), comma-separated, e.g. orange,teal,blue,magenta: "
                             "each trainer on each concept's suite dataset, scored by the suite's measures and "
                             "targets (default: the demo's purple dataset alone, scored as above)")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="every trainer's --max_train_steps (a quick slice; default: each trainer's own)")
    parser.add_argument("--stabletune-only", action="store_true",
                        help="with --concepts: StableTune's row alone (no peer script needed)")
    parser.add_argument("--out", type=Path, required=True, help="a new or empty folder for runs and results")
    args = parser.parse_args()
    budgets = parse_budgets(args.budgets)
    args.concepts = parse_concepts(args.concepts)
    if args.concepts and args.family != "sd1":
        raise SystemExit("--concepts runs the concept suite on the toy SD 1.x base; leave --family at sd1.")
    if args.stabletune_only and not args.concepts:
        raise SystemExit("--stabletune-only is for a --concepts run; the demo's run compares with the example.")
    if args.score_seeds < 1:
        raise SystemExit(f"--render-seeds {args.score_seeds}: give at least 1 seed per prompt.")
    args.preset = (args.preset or default_preset(args.family)).resolve()
    if not args.preset.is_file():
        raise SystemExit(f"--preset {args.preset} is not a file; give a StableTune preset (.toml).")
    if not args.stabletune_only:
        check_peer(args)
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"--out {args.out} is not empty; give the bench a new folder (it never overwrites).")

    import torch

    from stabletune_core.config import read_toml
    from stabletune_core.demo import demo_assets

    torch.set_num_threads(args.threads)
    preset = read_toml(args.preset)
    if preset.get("model_family", "sd1") != args.family:
        raise SystemExit(f"--preset {args.preset} trains model_family {preset.get('model_family', 'sd1')!r}, not "
                         f"--family {args.family}.")
    if args.concepts:
        args.out.mkdir(parents=True, exist_ok=True)
        return run_suite(args, budgets, preset)
    model, data = demo_assets(family=args.family)
    peer_data = write_imagefolder(dataset_images(data), args.out / "peer-data")
    shown = args.preset.relative_to(ROOT) if args.preset.is_relative_to(ROOT) else args.preset
    trainers = [(f"StableTune ({shown})", "stabletune", args.preset)]
    if args.without_samples_row:
        quiet = preset_without_samples(args.preset, args.out / "preset-without-samples.toml")
        trainers.append((f"StableTune ({shown}, no validation images)", "stabletune", quiet))
    trainers += [(name, "peer", row) for name, row in peer_rows(args.family, preset)]

    rows = train_rows(args, trainers, budgets, model, data, peer_data, args.out, preset)

    print("Scoring (fresh toy pipeline per LoRA) ...", file=sys.stderr)
    base = score(model, None, data, family=args.family, seeds_per_prompt=args.score_seeds)
    base_images = base.pop("images")
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
               "family": args.family, "preset": str(args.preset), "threads": args.threads,
               "score_seeds_per_prompt": args.score_seeds, "budgets_min": budgets,
               "snapshot_steps": args.snapshot_steps, "base_model": base, "complete": False, "rows": rows}
    scored: dict[Path, dict] = {}  # a run that ended early offers one snapshot to several budgets
    for row in rows:
        row["budgets"] = [None] * len(budgets)
    for b, row in scoring_order(rows, len(budgets)):
        snap = row["chosen"][b]
        if snap.path not in scored:
            lora = stabletune_lora(snap.path, row["env"]) if row["kind"] == "stabletune" else peer_lora(snap.path)
            scored[snap.path] = score(model, lora, data, base_images, args.family, args.score_seeds)
            del scored[snap.path]["images"]
            print(f"{row['name']}, {budgets[b]:g} min, step {snap.step} ({snap.seconds:.0f} s): "
                  f"{scored[snap.path]}", file=sys.stderr)
        row["budgets"][b] = {"step": snap.step, "seconds": round(snap.seconds, 1), **scored[snap.path]}
        write_results(args.out / "results.json", results)  # a run stopped while scoring keeps what it scored
    results["complete"] = True
    write_results(args.out / "results.json", results)
    print(f"\nToy {args.family} base without a LoRA: concept {base['concept_error']:.0f} deg off, base shapes "
          f"{base['shapes'] * 100:.0f} %; "
          f"{args.threads} threads, snapshots every {args.snapshot_steps} steps, {args.score_seeds} seeds per prompt, "
          f"{results['date']}")
    print(markdown_table(rows, budgets))
    for row in rows:
        print(run_summary(row))
    print(f"\nRuns, logs and results.json: {args.out}")


if __name__ == "__main__":
    main()
