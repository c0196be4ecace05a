"""A checkpoint comparison grid: which epoch, at which LoRA strength, looks best, judged by eye.

For a finished or running run, renders every chosen checkpoint at every chosen LoRA strength (e.g. 0, 0.5, 0.75,
1) with fixed seeds for the run's validation prompts, and beside each row the base model's own image (adapters
off) at the same prompt and seed; the same sampler, steps and guidance as the run's validation images, so the
base column is the run's step-0 image and strength 1 at a sampled step is that step's validation image. One PNG,
RUN/grids/NAME.png, written atomically; RUN/grids/NAME.json says how far it is (the UI shows it) and where each
image sits in the PNG.

`python -m stabletune_core grid RUN --checkpoints step_000100,step_000200 --strengths 0,0.5,0.75,1 --seeds 1,2`

It runs as a process of its own in the trainer's Python, never inside a training process, and only reads the
run: checkpoints are verified against their manifest and read, nothing in them is written, so a running training
and its exact resume are untouched. The weights drawn are the checkpoint's trained adapter (what `export` writes
as the LoRA); an EMA average or a schedule-free optimizer's averaged weights are not used here.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from .atomic import atomic_path, write_text_atomic
from .config import ConfigError, TrainConfig
from .runs.layout import RunPaths, checkpoint_adapter, step_of

DEFAULT_STRENGTHS = (0.0, 0.5, 0.75, 1.0)
MIN_CELL = 128  # px: smaller images (the toy model's 64 px) are enlarged, pixel for pixel, to be seen
LABEL_W, HEAD_H, PAD = 170, 22, 4
MAX_SEED = 2**32 - 1  # what a seeded torch generator takes on every platform


class GridError(ConfigError):
    """What the grid cannot do, in one sentence (the CLI prints it and exits 2)."""


# ---- what to render ---------------------------------------------------------------------------------------------
def checkpoint_folders(run: Path, chosen: list[str] | None) -> list[Path]:
    """The checkpoint folders `chosen` names (step_000100, 100, "last", "all"), oldest first, each verified."""
    from .train.checkpoint import CheckpointError, list_checkpoints, verify_checkpoint

    folders = list_checkpoints(RunPaths(run).checkpoints)
    if not folders:
        raise GridError([f"{run} has no checkpoint yet; a grid compares checkpoints (they are saved every save_steps "
                         "and when a run stops)."])
    by_step = {step_of(f): f for f in folders}
    picked: list[Path] = []
    for name in chosen or ["last"]:
        name = str(name).strip()
        if name == "all":
            picked += folders
        elif name == "last":
            picked.append(folders[-1])
        else:
            step = int(name) if name.isdigit() else step_of(name)
            if step not in by_step:
                raise GridError([f"{run.name} has no checkpoint {name}; it has "
                                 f"{', '.join(f.name for f in folders)}."])
            picked.append(by_step[step])
    picked = sorted(set(picked), key=step_of)
    for folder in picked:
        try:
            verify_checkpoint(folder)
        except CheckpointError as exc:
            raise GridError([f"{exc} Choose another checkpoint."]) from None
    return picked


def parse_numbers(text: str, kind: type, what: str) -> list[Any]:
    try:
        values = [kind(part) for part in str(text).replace(";", ",").split(",") if part.strip()]
    except ValueError:
        raise GridError([f"{what} must be numbers separated by commas, e.g. 0, 0.5, 1; got '{text}'."]) from None
    if not values:
        raise GridError([f"{what} is empty; give at least one, e.g. 0, 0.5, 1."])
    odd = next((v for v in values if not math.isfinite(v)), None) if kind is float else \
        next((v for v in values if not 0 <= v <= MAX_SEED), None)
    if odd is not None:  # a NaN or infinite strength draws black cells; a seed out of range fails in torch
        allowed = "finite numbers, e.g. 0, 0.5, 1" if kind is float else f"whole numbers from 0 to {MAX_SEED}"
        raise GridError([f"{what} holds {odd}; give {allowed}."])
    return values


# ---- the model, its adapters, their strength ------------------------------------------------------------------
def load_with_adapters(config: TrainConfig, device: Any) -> tuple[Any, dict[str, Any], Any, Any]:
    """(bundle, {checkpoint prefix: adapted module}, autocast, the pivotal tokens or None) as the run trained them,
    on `device`; the new tokens' rows start from their init words, as at the run's step 0 (the base column)."""
    import torch

    from .lora.inject import add_lora, lora_parameters
    from .lora.pivotal import add_pivotal_tokens
    from .models.loading import load_model
    from .train.amp import MixedPrecision
    from .train.placement import place_models

    bundle = load_model(config)  # with the run's prediction_type, as it trained
    add_lora(bundle, config)
    pivotal = add_pivotal_tokens(bundle, config)
    amp = MixedPrecision(config.mixed_precision, device)
    dtype = amp.weight_dtype
    place_models(bundle, device, dtype, config.mixed_precision)
    adapted = {"unet": bundle.denoiser, **({f"te{i}": e for i, e in enumerate(bundle.text_encoders)}
                                       if config.train_text_encoder else {})}  # the prefixes of train/state.py
    for module in adapted.values():
        for p in lora_parameters(module):  # adapters in fp32, as they trained (train/setup.py)
            p.data = p.data.float()
        module.requires_grad_(False)
    if pivotal:
        pivotal.set_training(False)
    return bundle, adapted, amp.autocast, pivotal


def read_adapter(checkpoint: Path) -> dict[str, dict[str, Any]]:
    """The checkpoint's adapter weights by module prefix ('<prefix>.<peft key>' in adapter.safetensors), read at
    once: a running training may prune an old checkpoint while the grid renders."""
    from safetensors.torch import load_file

    by_prefix: dict[str, dict[str, Any]] = {}
    for key, value in load_file(checkpoint_adapter(checkpoint)).items():
        prefix, name = key.split(".", 1)
        by_prefix.setdefault(prefix, {})[name] = value
    return by_prefix


def load_adapter(adapted: dict[str, Any], weights: dict[str, dict[str, Any]], pivotal: Any = None) -> None:
    from .lora.inject import load_lora_state_dict
    from .lora.pivotal import CHECKPOINT_PREFIX

    for prefix, module in adapted.items():
        load_lora_state_dict(module, weights.get(prefix, {}))
    if pivotal is not None:  # the new tokens' rows of the checkpoint ('pivotal.te0', ...)
        pivotal.load_state_dict({f"{CHECKPOINT_PREFIX}.{k}": v for k, v in weights.get(CHECKPOINT_PREFIX, {}).items()})


def adapter_layers(adapted: dict[str, Any]) -> list[Any]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for module in adapted.values() for m in module.modules() if isinstance(m, BaseTunerLayer)]


@contextmanager
def strength(layers: list[Any], value: float | None) -> Iterator[None]:
    """Inside, every adapter adds `value` times its trained change (as <lora:NAME:value> in a WebUI); None: the
    adapters are off, the base model alone. Afterwards they are as trained."""
    saved = [dict(layer.scaling) for layer in layers]
    try:
        for layer, scales in zip(layers, saved):
            if value is None:
                layer.enable_adapters(False)
            else:
                for name, scale in scales.items():
                    layer.scaling[name] = scale * value
        yield
    finally:
        for layer, scales in zip(layers, saved):
            layer.enable_adapters(True)
            layer.scaling.update(scales)


# ---- rendering -------------------------------------------------------------------------------------------------
class Cancelled(Exception):
    """The user cancelled the grid (the UI's Cancel, Ctrl-C, SIGTERM)."""


def seed_runs(seeds: list[int]) -> list[tuple[int, int]]:
    """`seeds` as (first, count) runs of consecutive seeds, in order: the validation images of one call are the seeds
    first, first+1, ... (train/validation_images.sample_seeds), so a run of them is one call."""
    runs: list[tuple[int, int]] = []
    for seed in seeds:
        if runs and seed == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((seed, 1))
    return runs


def render(config: TrainConfig, bundle: Any, autocast: Any, device: Any, prompts: list[str], seeds: list[int],
           steps: int | None, should_stop: Any = None) -> dict[tuple[int, int], Any]:
    """{(prompt index, seed): image} for every prompt at every seed, made as the run's validation images are
    (train/validation_images.py): one call for a run of consecutive seeds, as a sampling inside training renders
    its prompts x seeds (a call builds a pipeline and frees memory after it). Raises Cancelled when `should_stop`
    says so, at the next image."""
    from PIL import Image

    from .train.validation_images import make_validation_images

    images: dict[tuple[int, int], Any] = {}
    for first, count in seed_runs(seeds):
        batch = config.model_copy(update={"validation_prompt": " | ".join(prompts), "seed": first,
                                          "num_validation_images": count,
                                          "validation_inference_steps": steps or config.validation_inference_steps})
        with tempfile.TemporaryDirectory(prefix="stabletune-grid-") as folder:
            paths = make_validation_images(bundle, batch, Path(folder), device, autocast=autocast,
                                           should_stop=should_stop)
            if len(paths) < len(prompts) * count:
                raise Cancelled()
            for path in paths:  # p<prompt>_s<seed>.png
                prompt, seed = path.stem[1:].split("_s")
                with Image.open(path) as image:
                    images[(int(prompt), int(seed))] = image.convert("RGB")
    return images


def use_cpu_threads(bundle: Any, device: Any, say: Any) -> None:
    """On a CPU, the threads a training of this model computes on (train/threads.py): torch's one thread per core
    made the grid 10-30x slower per image than the run's own sampling on a small model or a busy machine."""
    if device.type != "cpu":
        return
    from .train.threads import set_cpu_threads

    _, sentence = set_cpu_threads(bundle.denoiser)
    say("grid: " + sentence.replace("Training with", "Rendering with", 1))


def render_grid(run: Path, *, checkpoints: list[str] | None = None, strengths: list[float] = DEFAULT_STRENGTHS,
                seeds: list[int] | None = None, prompts: list[str] | None = None, name: str | None = None,
                steps: int | None = None, device: str = "auto", say: Any = print) -> Path:
    """Render the grid of `run` into RUN/grids/NAME.png and return its path (see the module doc)."""
    import torch

    run = Path(run).resolve()
    paths = RunPaths(run)
    if not paths.config.is_file():
        raise GridError([f"{run} is not a run folder (it has no config.toml)."])
    config = TrainConfig.from_toml(paths.config)
    prompts = prompts or config.validation_prompts
    if not prompts:
        raise GridError([f"{run.name} has no validation prompt; pass --prompt \"...\" (repeatable)."])
    seeds = seeds or [config.seed + i for i in range(config.num_validation_images)]
    folders = checkpoint_folders(run, checkpoints)
    weights = {folder.name: read_adapter(folder) for folder in folders}  # before the model loads (seconds)
    name = name or f"grid-{time.strftime('%Y%m%d-%H%M%S')}"
    if not name.replace("-", "").replace("_", "").isalnum():
        raise GridError([f"Grid name '{name}' may hold letters, digits, - and _ only."])
    target = paths.grids / f"{name}.png"
    if target.exists():
        raise GridError([f"{target} already exists; choose another --name (grids are never overwritten)."])
    target.parent.mkdir(exist_ok=True)
    where = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                         ("cpu" if device == "auto" else device))
    layout = {"run": str(run), "checkpoints": [f.name for f in folders], "strengths": list(strengths),
              "seeds": list(seeds), "prompts": list(prompts), "device": str(where)}
    total = len(seeds) * (1 + len(folders) * len(strengths))
    progress = Progress(target.with_suffix(".json"), layout, total, say)
    cancel = paths.grid_cancel(name)  # a Cancel clicked while this process started is kept: it cancels
    previous = _sigterm_cancels()
    try:
        if cancel.exists():
            raise Cancelled()
        progress.doing("loading the model")
        bundle, adapted, autocast, pivotal = load_with_adapters(config, where)
        use_cpu_threads(bundle, where, say)
        layers = adapter_layers(adapted)
        cells: dict[tuple, Any] = {}
        loaded = None
        for folder, value in [(None, None), *((f, v) for f in folders for v in strengths)]:
            what = "the base model (no LoRA)" if folder is None else f"{folder.name} at strength {value:g}"
            progress.doing(f"rendering {what}: {len(prompts)} prompt(s) x {len(seeds)} seed(s)")
            if folder is not None and folder != loaded:  # one checkpoint's weights for all its strengths
                load_adapter(adapted, weights[folder.name], pivotal)
                loaded = folder
            with strength(layers, value):
                made = render(config, bundle, autocast, where, prompts, seeds, steps, should_stop=cancel.exists)
            for (p, seed), image in made.items():
                cells[("base" if folder is None else folder.name, value, p, seed)] = image
            progress.step(what, len(seeds))
            if cancel.exists():
                raise Cancelled()
        progress.doing("writing the PNG")
        sheet, boxes = compose(cells, folders, strengths, seeds, prompts)
        with atomic_path(target) as tmp:
            sheet.save(tmp, format="PNG")
    except (Cancelled, KeyboardInterrupt):
        progress.end("cancelled", error="cancelled; no grid was written")
        raise Cancelled() from None
    except BaseException as exc:
        progress.end("failed", error=" ".join(getattr(exc, "problems", None) or [str(exc) or type(exc).__name__]))
        raise
    finally:
        cancel.unlink(missing_ok=True)
        _restore_sigterm(previous)
    progress.end("finished", png=str(target), cells=boxes)
    return target


def _sigterm_cancels() -> Any:
    """SIGTERM (a host stopping the grid's process) cancels as Ctrl-C does: the progress file says `cancelled`."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def cancel(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, cancel)


def _restore_sigterm(previous: Any) -> None:
    import signal

    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


class Progress:
    """RUN/grids/NAME.json, rewritten as images are made: state, done/total, then the layout of the PNG."""

    def __init__(self, path: Path, layout: dict[str, Any], total: int, say: Any) -> None:
        self.path, self.say = path, say
        self.data = {**layout, "state": "rendering", "done": 0, "total": total, "started_at": time.time(),
                     "pid": os.getpid(), "doing": "starting"}
        self.first_row_at: float | None = None
        self._write()

    def doing(self, what: str) -> None:
        """What the grid does now, for the UI's progress line (loading the model takes a while)."""
        self.data["doing"] = what
        if what.startswith("rendering") and self.first_row_at is None:
            self.first_row_at = self.data["rendering_since"] = time.time()  # the model loaded (bench/grid_speed.py)
        self._write()

    def step(self, what: str, rows: int = 1) -> None:
        self.data["done"] += rows
        if self.first_row_at is not None:  # the time per row, the model load left out: the time left
            per_row = (time.time() - self.first_row_at) / self.data["done"]
            self.data["seconds_left"] = round(per_row * (self.data["total"] - self.data["done"]), 1)
        self.say(f"grid: {self.data['done']}/{self.data['total']} {what}")
        self._write()

    def end(self, state: str, **fields: Any) -> None:
        self.data.update(state=state, ended_at=time.time(), **fields)
        self._write()

    def _write(self) -> None:
        write_text_atomic(self.path, json.dumps(self.data, indent=1), durable=False)


def compose(cells: dict[tuple, Any], folders: list[Path], strengths: list[float], seeds: list[int],
            prompts: list[str]) -> tuple[Any, list[dict[str, Any]]]:
    """The PNG: a block per prompt and seed, a row per checkpoint, the base image then one column per strength.
    Returns it and where each image sits ({"checkpoint", "strength", "prompt", "seed", "box"})."""
    from PIL import Image, ImageDraw, ImageFont

    first = next(iter(cells.values()))
    scale = max(1, math.ceil(MIN_CELL / first.width))
    cell = first.width * scale, first.height * scale
    columns = ["base", *(f"strength {v:g}" for v in strengths)]
    blocks = [(p, seed) for p in range(len(prompts)) for seed in seeds]
    width = LABEL_W + len(columns) * (cell[0] + PAD)
    height = HEAD_H + len(blocks) * (HEAD_H + len(folders) * (cell[1] + PAD))
    sheet = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default()
    for c, title in enumerate(columns):
        draw.text((LABEL_W + c * (cell[0] + PAD) + 4, 4), title, fill="black", font=font)
    boxes = []
    y = HEAD_H
    for p, seed in blocks:
        draw.text((4, y + 4), f"{prompts[p]} · seed {seed}", fill="black", font=font)
        y += HEAD_H
        for folder in folders:
            draw.text((4, y + cell[1] // 2 - 6), f"step {int(folder.name.split('_')[1])}", fill="black", font=font)
            for c, (key, value) in enumerate([("base", None), *((folder.name, v) for v in strengths)]):
                x = LABEL_W + c * (cell[0] + PAD)
                sheet.paste(cells[(key, value, p, seed)].resize(cell, Image.NEAREST), (x, y))
                boxes.append({"checkpoint": None if key == "base" else folder.name, "strength": value,
                              "prompt": p, "seed": seed, "box": [x, y, x + cell[0], y + cell[1]]})
            y += cell[1] + PAD
    return sheet, boxes


# ---- the CLI: python -m stabletune_core grid RUN ... --------------------------------------------------------------
def add_parser(commands: Any) -> None:
    grid = commands.add_parser("grid", help="Render chosen checkpoints x LoRA strengths x seeds of a run's validation "
                               "prompts, the base image beside each, into RUN/grids/NAME.png.")
    grid.add_argument("run", help="The run folder.")
    grid.add_argument("--checkpoints", default="last", help="Comma-separated: step_000100, 100, last or all "
                      "(default: last).")
    grid.add_argument("--strengths", default="0,0.5,0.75,1", help="Comma-separated LoRA strengths (default "
                      "0,0.5,0.75,1).")
    grid.add_argument("--seeds", default=None, help="Comma-separated seeds (default: the run's validation seeds).")
    grid.add_argument("--prompt", action="append", default=None, help="A prompt (repeatable; default: the run's "
                      "validation prompts).")
    grid.add_argument("--steps", type=int, default=None, help="Denoising steps (default: the run's validation "
                      "steps).")
    grid.add_argument("--name", default=None, help="File name in RUN/grids (default grid-<time>).")
    grid.add_argument("--device", default="auto", help="cuda, cpu or auto (default: cuda when there is one).")
    grid.set_defaults(run_tool=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    """Render; bad input is one `error:` line (exit 2), as for every command."""
    try:
        path = render_grid(Path(args.run), checkpoints=args.checkpoints.split(","),
                           strengths=parse_numbers(args.strengths, float, "--strengths"),
                           seeds=parse_numbers(args.seeds, int, "--seeds") if args.seeds else None,
                           prompts=args.prompt, name=args.name, steps=args.steps, device=args.device)
    except GridError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    except Cancelled:
        print("error: grid cancelled; no grid was written (the run is untouched).", file=sys.stderr)
        return 130
    print(f"Grid written to {path}")
    return 0
