"""The memory model against a measurement (issue 36 item 5, the CPU half): for each plan the tiny models can take,
a few real training steps on the CPU (the engine's run, in this process) with every live tensor's bytes counted, the
peak beside the estimate of the same settings (models/flux2_klein/memory.py, models/sd/sdxl_memory.py,
models/z_image/memory.py priced from the tiny model's own configs).

Plans: base_storage full / int8 / nf4, gradient checkpointing on / off, text embeddings cached or not, and blocks
swapped where the family has them (swap needs checkpointing): 0 or 2 of the tiny Klein's 4, 0, 3 or all 6 of the tiny
Z-Image's (3: a context refiner and both main layers). fp8 needs a GPU.

What is measured: the bytes of every tensor storage alive, counted by a TorchDispatchMode (LiveTensorBytes) from
the ops that make or read each tensor and released when torch frees the storage; its peak over the whole run (set-up
and caching included), so weights count from their first use. The estimate's CUDA context (0.8 GiB) and its 5 %
for fragmentation have no counterpart here: the table compares the measurement with the estimate less those
(`estimate, tensors only`), and shows the full estimate too.

Why not torch's MemTracker (torch.distributed._tools.mem_tracker), which also counts CPU tensors: it sees the
tensors made under it and those handed to track_external, and the engine loads its models inside run_train where
this script cannot hand them over (safetensors' tensors are not made by an op); counting every op's inputs as well
as its outputs catches each weight at its first use, which is before the first training step's peak.

    python bench/cpu_peak.py                       # every plan, every tiny model, a markdown table on stdout
    python bench/cpu_peak.py --family flux2_klein --steps 2 --json rows.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

KIB = 1024


class LiveTensorBytes(TorchDispatchMode):
    """The bytes of the tensor storages alive, counted from every op's inputs and outputs (a storage counts once,
    however many views; it stops counting when torch frees it), and the peak. Thread-local, as dispatch modes are:
    what other threads make (the data loader's images) is not seen until an op here reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.phase = "set-up"
        self.peaks: dict[str, int] = {}  # phase -> its peak

    @property
    def peak(self) -> int:
        return max(self.peaks.values(), default=0)

    def _count(self, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":
            return
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # a tensor without a storage of its own
            return
        key = storage._cdata  # the StorageImpl: one per allocation, whichever view or Python object reaches it
        if key in self.live:
            return
        size = storage.nbytes()
        self.live[key] = size
        self.current += size
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for leaf in tree_leaves((args, kwargs or {})):
            if isinstance(leaf, torch.Tensor):
                self._count(leaf)
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._count(leaf)
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), self.current)
        return out


def _build_klein(out: Path) -> Path:
    from stabletune_core.models.flux2_klein.tiny import build_tiny_klein

    return build_tiny_klein(out, seed=0)


def _build_sdxl(out: Path) -> Path:
    from stabletune_core.models.sd.tiny import build_tiny_sdxl

    return build_tiny_sdxl(out, seed=0)


def _build_z_image(out: Path) -> Path:
    from stabletune_core.models.z_image.tiny import build_tiny_z_image

    return build_tiny_z_image(out, seed=0)


def _estimate_klein(config, model: Path):
    from stabletune_core.models.flux2_klein.memory import config_memory_sentence

    return config_memory_sentence(config, from_configs=True)[1]


def _estimate_sdxl(config, model: Path):
    from stabletune_core.models.sd.sdxl_memory import sdxl_memory_sentence

    return sdxl_memory_sentence(config, model)[1]


def _estimate_z_image(config, model: Path):
    from stabletune_core.models.z_image.memory import z_image_memory_sentence

    return z_image_memory_sentence(config, Path(model))[1]


@dataclass(frozen=True)
class TinyFamily:
    """A family the bench measures: its name in the table, how its tiny model is built, how the memory model prices
    a run of it from the tiny model's own configs, and the blocks swapped in the plans with checkpointing."""

    label: str
    build: Callable[[Path], Path]
    estimate: Callable[[Any, Path], Any]
    swaps: tuple[int, ...] = (0,)


FAMILIES = {
    "flux2_klein": TinyFamily("tiny Klein", _build_klein, _estimate_klein, swaps=(0, 2)),
    "sdxl": TinyFamily("tiny SDXL", _build_sdxl, _estimate_sdxl),
    "z_image": TinyFamily("tiny Z-Image", _build_z_image, _estimate_z_image, swaps=(0, 3, 6)),
}


def plans(family: str) -> list[dict[str, Any]]:
    """Every plan the tiny model can take on the CPU."""
    rows = []
    for storage, checkpointing, cached in itertools.product(("full", "int8", "nf4"), (True, False), (True, False)):
        swaps = FAMILIES[family].swaps if checkpointing else (0,)
        rows += [dict(base_storage=storage, gradient_checkpointing=checkpointing, cache_text_embeddings=cached,
                      blocks_to_swap=swapped) for swapped in swaps]
    return rows


def build_models(out: Path, families: list[str]) -> dict[str, Path]:
    return {family: FAMILIES[family].build(out / f"tiny-{family}") for family in families}


def plan_config(model: Path, data: Path, out: Path, plan: dict[str, Any], steps: int):
    from stabletune_core.config import build_config

    return build_config(dict(pretrained_model_name_or_path=str(model), train_data_dir=str(data), output_dir=str(out),
                             resolution=64, bucket_step=8, min_bucket_reso=32, max_bucket_reso=128, lora_rank=4,
                             train_batch_size=1, max_train_steps=steps, validation_split=0, seed=3, **plan))


def estimate(config, family: str, model: Path):
    """The memory model's estimate of this run, the tiny model priced from its own configs."""
    return FAMILIES[family].estimate(config, model)


def tensors_only(guess) -> int:
    """The estimate less what has no CPU counterpart (the CUDA context, the allowance for fragmentation): the
    larger of the step's weights + LoRA + activations and the caching's bytes."""
    from stabletune_core.models.memory import CONTEXT_BYTES, FRAGMENTATION

    caching = round((guess.setup - CONTEXT_BYTES) / (1 + FRAGMENTATION)) if guess.setup else 0
    return max(guess.weights + guess.lora + guess.activations, caching)


def measure(family: str, model: Path, data: Path, out: Path, plan: dict[str, Any], steps: int) -> dict[str, Any]:
    """One plan's run under LiveTensorBytes: the row of the table."""
    from stabletune_core.cli import run_train

    config = plan_config(model, data, out, plan, steps)
    guess = estimate(config, family, model)
    from stabletune_core.train import loop

    counter = LiveTensorBytes()
    step = loop.training_step

    def training_step(*args, **kwargs):  # the set-up's peak (models loaded, caches built) and the steps' apart
        counter.phase = "training"
        return step(*args, **kwargs)

    loop.training_step = training_step
    try:
        with counter:
            code = run_train(config)
    finally:
        loop.training_step = step
    if code != 0:
        raise SystemExit(f"the {family} run of {plan} failed; see {out}")
    expected = tensors_only(guess)
    step_expected = guess.weights + guess.lora + guess.activations
    return dict(family=family, **plan, estimate_bytes=guess.peak, estimate_tensor_bytes=expected,
                estimate_step_bytes=step_expected, weights_bytes=guess.weights, lora_bytes=guess.lora,
                activation_bytes=guess.activations, measured_peak_bytes=counter.peak,
                measured_setup_bytes=counter.peaks["set-up"], measured_step_bytes=counter.peaks["training"],
                ratio=counter.peak / expected, step_ratio=counter.peaks["training"] / step_expected)


def plan_name(row: dict[str, Any]) -> str:
    parts = [row["base_storage"], "ckpt" if row["gradient_checkpointing"] else "no ckpt",
             "text cached" if row["cache_text_embeddings"] else "text encoder kept"]
    if row["blocks_to_swap"]:
        parts.append(f"{row['blocks_to_swap']} swapped")
    return ", ".join(parts)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | plan | estimate (MiB, with 0.8 GiB context) | estimate, tensors only (KiB) | weights / LoRA / "
             "activations by the estimate (KiB) | measured peak (KiB) | measured / estimate | measured: set-up / "
             "training steps (KiB) | steps: measured / estimate |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {FAMILIES[r['family']].label} | {plan_name(r)} | "
                     f"{r['estimate_bytes'] / KIB ** 2:.0f} | {r['estimate_tensor_bytes'] / KIB:.0f} | "
                     f"{r['weights_bytes'] / KIB:.0f} / {r['lora_bytes'] / KIB:.0f} / {r['activation_bytes'] / KIB:.0f}"
                     f" | {r['measured_peak_bytes'] / KIB:.0f} | {r['ratio']:.2f} | "
                     f"{r['measured_setup_bytes'] / KIB:.0f} / {r['measured_step_bytes'] / KIB:.0f} | "
                     f"{r['step_ratio']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=(*FAMILIES, "all"), default="all")
    parser.add_argument("--steps", type=int, default=3, help="training steps per plan")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    from stabletune_core.demo import draw_demo_dataset

    families = list(FAMILIES) if args.family == "all" else [args.family]
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        models = build_models(work, families)
        data = draw_demo_dataset(work / "data", count=8, size=64, seed=0)
        for family in families:
            for i, plan in enumerate(plans(family)):
                rows.append(measure(family, models[family], data, work / "runs" / f"{family}-{i}", plan, args.steps))
                print(json.dumps(rows[-1]), file=sys.stderr)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
