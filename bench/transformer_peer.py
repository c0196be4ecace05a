"""A transformer family side by side with diffusers' example script (FLUX.2 Klein, issue 23 item 6; Z-Image with
`--family z_image`, issue 39 item 6): seconds per step, peak memory and time to the first optimizer step, on the same
model and the same data. (Named klein_peer.py until it ran Z-Image too.)

Both trainers get the same model (by default the family's tiny real-layout model, e.g. the Klein of
stabletune_core/models/flux2_klein/tiny.py, built into --out; `--model DIR` takes any diffusers folder of the family
instead, e.g. a toy Klein base or the real-size
random 4B that bench/klein_gpu.py writes), the same toy-world images and captions (stabletune_core/toy/world.py:
purple shapes and shapes in the base colours, 64 px), and the same seed, steps, LoRA rank and alpha, learning rate,
batch, resolution, precision and LoRA targets (the example's default list, StableTune's preset
"diffusers_default"). The example gets `--text_encoder_out_layers 9 18 27`: the layers Flux2KleinPipeline (and
StableTune) read; the example's own default, 10 20 30, differs from the pipeline's and does not exist in the
tiny 28-layer text encoder.

Each trainer runs as its own process under bench/step_probe.py and is timed by bench/first_step.py's `timed`:
"first step" is from Popen to the end of optimizer step 1 (imports, model load, caching and set-up included),
"s/step" is (end of step N - end of step 10) / (N - 10), peak RSS is the trainer process's high-water mark up to
step N (CPU), peak CUDA memory torch.cuda.max_memory_allocated up to step N (GPU). No snapshots are written.

Rows, in ABC CBA order over rounds (a load change hits every row alike); medians; ratios StableTune / example:
- StableTune, same work as the example: latents and text embeddings cached (the example caches both when every
  image has its own caption), no validation images, no validation loss, no held-out split;
- diffusers example (`examples/dreambooth/train_dreambooth_lora_flux2_klein.py`, never committed; its `datasets`
  dependency from --peer-pythonpath), the captions through --dataset_name (an imagefolder) --caption_column text;
- StableTune with its defaults for what the example does not set (no caches, its Klein defaults), the same
  shared knobs: what a user who only names the model and data gets.

    python bench/transformer_peer.py --peer-script /tmp/peer-klein/train_dreambooth_lora_flux2_klein.py \\
        --peer-pythonpath /tmp/peerlib --steps 40 --rounds 2 --threads 2 --out /tmp/klein-peer

Quality per minute on the toy Klein base (what each trainer has learned after the same minutes, scored by the toy
judge) is bench/toy_quality.py `--family flux2_klein`, which builds the example's command with the same
`peer_command` (bench/transformer_example.py);
`--model toy` here runs both trainers on that base for speed and memory.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from first_step import timed  # noqa: E402
from toy_quality import dataset_images, thread_env, write_imagefolder  # noqa: E402
from transformer_example import FAMILIES, KLEIN, NO_SNAPSHOTS, PeerFamily, Setting, peer_command  # noqa: E402

CONCEPT_IMAGES = 12
BASE_IMAGES = 12
ROW_SAME_WORK = "StableTune, same work as the example"
ROW_PEER = "diffusers example"
ROW_DEFAULTS = "StableTune, its defaults otherwise"
SAME_WORK = ["--cache_latents", "--cache_text_embeddings", "--validation_prompt", "", "--validation_loss_every", "0",
             "--validation_split", "0"]
TOY = "toy"  # --model toy: the toy Klein base trained on the toy world


def stabletune_command(model: Path, data: Path, run: Path, s: Setting, same_work: bool,
                       family: PeerFamily = KLEIN) -> list[str]:
    """`python -m stabletune_core train` arguments (after the probe) for one row."""
    command = ["-m", "stabletune_core", "train", "--pretrained_model_name_or_path", str(model),
               "--train_data_dir", str(data), "--output_dir", str(run), "--model_family", family.name,
               "--max_train_steps", str(s.steps), "--lora_rank", str(s.rank), "--lora_alpha", str(s.lora_alpha),
               "--learning_rate", str(s.learning_rate), "--train_batch_size", str(s.batch),
               "--resolution", str(s.resolution), "--seed", str(s.seed), "--mixed_precision", s.precision,
               "--save_steps", str(NO_SNAPSHOTS), "--unet_lora_targets", *family.targets()]
    if s.gradient_checkpointing:
        command.append("--gradient_checkpointing")
    return command + (SAME_WORK if same_work else [])


def write_toy_data(out: Path, size: int = 64) -> tuple[Path, Path]:
    """The toy world's images (drawn at `size` px, the run's resolution: neither trainer rescales them) as a
    StableTune dataset (kohya sub-folders, .txt captions) and the same images and captions as the example's
    imagefolder; refuses folders that already hold files."""
    from stabletune_core.toy.world import base_scenes, concept_scenes, write_dataset

    data = Path(out) / "data"
    if data.exists() and any(data.iterdir()):
        raise FileExistsError(f"{data} is not empty; give the bench a new --out folder.")
    write_dataset(data / "1_purple", concept_scenes(CONCEPT_IMAGES), size=size)
    write_dataset(data / "1_known_colours", base_scenes(BASE_IMAGES), size=size)
    return data, write_imagefolder(dataset_images(data), Path(out) / "peer-data")


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """ABC, CBA, ABC, ...: each round's order of the rows."""
    return [list(names) if r % 2 == 0 else list(reversed(names)) for r in range(rounds)]


def median_row(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0] if key != "load"}


def markdown_table(results: dict[str, list[dict[str, float]]], steps: int) -> str:
    """One line per row, medians over rounds, and each against the example's medians."""
    peer = median_row(results[ROW_PEER]) if results.get(ROW_PEER) else None
    memory = "peak CUDA (MiB)" if any(r["peak_cuda_mib"] for runs in results.values() for r in runs) else \
        "peak RSS (MiB)"
    key = "peak_cuda_mib" if memory.startswith("peak CUDA") else "peak_rss_mib"
    lines = [f"| trainer | first step (s) | s/step, steps 10-{steps} | {memory} | first step vs example | "
             "s/step vs example | memory vs example | load avg at each start |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    ratio = (lambda a, b: f"{a / b:.2f}") if peer else (lambda a, b: "")
    for name, runs in results.items():
        m = median_row(runs)
        loads = ", ".join(f"{r['load']:.1f}" for r in runs)
        base = peer or m
        lines.append(f"| {name} | {m['first_step_s']:.1f} | {m['sec_per_step']:.3f} | {m[key]:.0f} | "
                     f"{ratio(m['first_step_s'], base['first_step_s'])} | "
                     f"{ratio(m['sec_per_step'], base['sec_per_step'])} | {ratio(m[key], base[key])} | {loads} |")
    return "\n".join(lines)


def check_args(args: argparse.Namespace) -> None:
    """One sentence before anything is built or run."""
    if args.steps <= 10:
        raise SystemExit("--steps must be above 10 (seconds per step are measured from step 10 on).")
    if args.peer_script is not None and not args.peer_script.is_file():
        raise SystemExit(f"--peer-script {args.peer_script} is not a file; give the path of diffusers' "
                         f"examples/dreambooth/{FAMILIES[args.family].example_script}.")
    if args.family != KLEIN.name and str(args.model) == TOY:
        raise SystemExit(f"--model {TOY} is the toy Klein base; for --family {args.family} give a diffusers folder "
                         "or leave --model out (the tiny model).")
    if args.model is not None and str(args.model) != TOY and not (args.model / "model_index.json").is_file():
        raise SystemExit(f"--model {args.model} is not a diffusers folder (it has no model_index.json).")
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"--out {args.out} is not empty; give the bench a new folder (it never overwrites).")


def toy_klein_base() -> Path:
    """The toy Klein base (issue 23 item 5, stabletune_core.toy.klein) as a diffusers folder, or one sentence when
    this checkout does not have it."""
    try:
        from stabletune_core.toy.klein import toy_klein_model

        return toy_klein_model()
    except (ImportError, FileNotFoundError) as exc:
        raise SystemExit(f"--model {TOY}: the toy Klein base is not in this checkout ({exc}); pass a Klein "
                         "diffusers folder instead.") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES), default=KLEIN.name,
                        help="the transformer family both trainers train (default flux2_klein)")
    parser.add_argument("--peer-script", type=Path, default=None,
                        help="diffusers' train_dreambooth_lora_<family>.py (never committed); without it only "
                             "the StableTune rows run")
    parser.add_argument("--peer-pythonpath", default=None, help="extra site folder for the example (datasets)")
    parser.add_argument("--model", type=Path, default=None,
                        help="a diffusers folder of the family, or 'toy' for the toy Klein base (default: the "
                             "family's tiny real-layout model with random weights, built into --out)")
    parser.add_argument("--steps", type=int, default=Setting.steps)
    parser.add_argument("--rank", type=int, default=Setting.rank)
    parser.add_argument("--learning-rate", type=float, default=Setting.learning_rate)
    parser.add_argument("--batch", type=int, default=Setting.batch)
    parser.add_argument("--resolution", type=int, default=Setting.resolution)
    parser.add_argument("--precision", choices=("no", "fp16", "bf16"), default=Setting.precision)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="same,peer,defaults",
                        help="which rows, comma-separated, of: same, peer, defaults")
    parser.add_argument("--out", type=Path, required=True, help="a new or empty folder")
    args = parser.parse_args(argv)
    args.setting = Setting(steps=args.steps, rank=args.rank, learning_rate=args.learning_rate, batch=args.batch,
                           resolution=args.resolution, precision=args.precision,
                           gradient_checkpointing=args.gradient_checkpointing)
    chosen = [part.strip() for part in args.rows.split(",") if part.strip()]
    unknown = sorted(set(chosen) - {"same", "peer", "defaults"})
    if unknown or not chosen:
        parser.error(f"--rows takes same, peer and defaults, not {','.join(unknown) or 'nothing'}")
    if args.peer_script is None:
        chosen = [row for row in chosen if row != "peer"]
    args.rows = chosen
    return args


def rows_for(args: argparse.Namespace, model: Path, data: Path, peer_data: Path) -> dict:
    """{row name: (command for a run folder, is it the example)} for the chosen rows, in the order asked."""
    s, family = args.setting, FAMILIES[args.family]
    every = {"same": (ROW_SAME_WORK, (lambda run: stabletune_command(model, data, run, s, True, family)), False),
             "peer": (ROW_PEER, (lambda run: peer_command(args.peer_script, model, peer_data, run, s,
                                                            family=family)), True),
             "defaults": (ROW_DEFAULTS, (lambda run: stabletune_command(model, data, run, s, False, family)), False)}
    return {every[key][0]: every[key][1:] for key in args.rows}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_args(args)
    model = toy_klein_base() if str(args.model) == TOY else args.model
    args.out.mkdir(parents=True, exist_ok=True)
    data, peer_data = write_toy_data(args.out, args.setting.resolution)
    if model is None:
        model = FAMILIES[args.family].build_tiny(args.out / f"tiny-{args.family}")
    rows = rows_for(args, model, data, peer_data)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in rows}
    for r, order in enumerate(round_orders(list(rows), args.rounds)):
        for name in order:
            command, is_peer = rows[name]
            tag = f"round{r}-row{list(rows).index(name)}"
            env = thread_env(args.threads, args.peer_pythonpath if is_peer else None)
            result = timed(command(args.out / tag), env, args.out / f"{tag}.times", args.out / f"{tag}.log",
                           args.setting.steps)
            results[name].append(result)
            print(f"round {r}: {name}: {json.dumps({k: round(v, 3) for k, v in result.items()})}", file=sys.stderr)
    (args.out / "results.json").write_text(json.dumps({"setting": vars(args.setting), "model": str(model),
                                                       "results": results}, indent=1))
    s = args.setting
    print(f"\n{model.name} ({args.family}): {args.threads} threads, {s.steps} steps, rank {s.rank}, lr {s.learning_rate:g}, batch "
          f"{s.batch}, {s.resolution} px, precision {s.precision}, gradient checkpointing "
          f"{'on' if s.gradient_checkpointing else 'off'}, {args.rounds} rounds (medians), load average "
          f"{os.getloadavg()[0]:.2f} at the end")
    print(markdown_table(results, s.steps))


if __name__ == "__main__":
    main()
