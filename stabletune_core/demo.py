"""The built-in demo: a tiny SD-architecture model with random weights and a drawn dataset, made locally.

A newcomer sees a whole run (loss falling, validation images, checkpoints, an exported LoRA) in about a
minute on a laptop CPU, with nothing downloaded.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

from PIL import Image, ImageDraw

from .config import TrainConfig, build_config, read_toml

PRESETS = Path(__file__).resolve().parent.parent / "presets"
COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 40)}
SHAPES = ("circle", "square", "triangle")


def cache_root() -> Path:
    return Path(os.environ.get("STABLETUNE_CACHE", Path.home() / ".cache" / "stabletune"))


def draw_shape(shape: str, color: tuple[int, int, int], size: int, rng: random.Random) -> Image.Image:
    background = tuple(rng.randint(200, 250) for _ in range(3))
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    radius = rng.randint(size // 5, size // 3)
    cx, cy = (rng.randint(radius, size - radius) for _ in range(2))
    box = (cx - radius, cy - radius, cx + radius, cy + radius)
    if shape == "circle":
        draw.ellipse(box, fill=color)
    elif shape == "square":
        draw.rectangle(box, fill=color)
    else:
        draw.polygon([(cx, cy - radius), (cx - radius, cy + radius), (cx + radius, cy + radius)], fill=color)
    return image


def draw_demo_dataset(folder: Path, *, count: int = 24, size: int = 64, seed: int = 0) -> Path:
    """Coloured shapes on pale backgrounds, each with a caption like 'a red circle'."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(count):
        shape = SHAPES[i % len(SHAPES)]
        color = list(COLORS)[(i // len(SHAPES)) % len(COLORS)]
        draw_shape(shape, COLORS[color], size, rng).save(folder / f"shape_{i:03d}.png")
        (folder / f"shape_{i:03d}.txt").write_text(f"a {color} {shape}")
    return folder


def demo_assets() -> tuple[Path, Path]:
    """The tiny model and the dataset, built once into the cache folder."""
    from .models.tiny import build_tiny_sd1

    root = cache_root() / "demo-v1"
    model, data = root / "tiny-sd1", root / "shapes"
    if not (model / "model_index.json").exists():
        build_tiny_sd1(model, seed=0)
    if not any(data.glob("*.png")) if data.exists() else True:
        draw_demo_dataset(data)
    return model, data


def free_run_dir(base: Path) -> Path:
    """runs/demo, or runs/demo-2, ... : an earlier demo run is never overwritten."""
    if not base.exists():
        return base
    n = 2
    while Path(f"{base}-{n}").exists():
        n += 1
    return Path(f"{base}-{n}")


def demo_config(output_dir: Path, *, max_train_steps: int | None = None, resume: bool = False) -> TrainConfig:
    model, data = demo_assets()
    values = read_toml(PRESETS / "demo.toml")
    values.update(pretrained_model_name_or_path=str(model), train_data_dir=str(data),
                  output_dir=str(output_dir if resume else free_run_dir(output_dir)))
    if resume:
        values["resume_from_checkpoint"] = "auto"
    if max_train_steps:
        values["max_train_steps"] = max_train_steps
    return build_config(values)
