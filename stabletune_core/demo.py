"""The built-in demo: the toy base model learns a colour it has never seen, in about two minutes on a CPU.

The toy base (stabletune_core/toy) is a small pretrained SD 1.x that draws red, yellow, green and cyan
shapes when asked; it has never seen purple. The demo trains a LoRA on 12 purple shapes, and its validation
images (same prompts, same seeds at every sampling) show purple appearing; the run ends with a one-line
learning summary scored by the toy world's colour judge. Nothing is downloaded.

`draw_demo_dataset` (random shapes in the base colours) stays for tests on random-weight models.
"""
from __future__ import annotations

import random
from pathlib import Path

from PIL import Image, ImageDraw

from .atomic import atomic_path
from .cache import cache_root
from .config import TOY_DEMO_RATES, TrainConfig, build_config, read_toml

PRESETS = Path(__file__).resolve().parent.parent / "presets"
COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 40)}
SHAPES = ("circle", "square", "triangle")


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


DEMO_IMAGES = 12  # of the new concept
DEMO_PRIOR_IMAGES = 24  # of colours the base already draws


def demo_assets() -> tuple[Path, Path]:
    """The toy base model and the demo dataset, built once into the cache folder.

    The dataset holds 12 purple shapes (the concept) and 24 shapes in the base colours, captioned the same way:
    prior preservation, as DreamBooth and kohya users do it. Without those, the LoRA finds the cheapest way to
    make purple (tint everything towards blue): measured on the toy base, red then comes out magenta (red
    100 % -> 0 %) and green cyan. With them, and a text-encoder LoRA that separates "purple" from "red" (its
    nearest word in the toy text encoder), every base colour stays at 100 % while purple goes 0 % -> 97 %.
    """
    from .toy import toy_base_model
    from .toy.world import CONCEPT_COLOR, base_scenes, concept_scenes, write_dataset

    model = toy_base_model()
    data = cache_root() / "demo-v3" / "purple-lora"
    if not data.is_dir():
        data.parent.mkdir(parents=True, exist_ok=True)
        try:
            with atomic_path(data, folder=True) as staging:
                write_dataset(staging / f"1_{CONCEPT_COLOR}", concept_scenes(DEMO_IMAGES))
                write_dataset(staging / "1_known_colours", base_scenes(DEMO_PRIOR_IMAGES, seed=78))
        except OSError:
            if not data.is_dir():
                raise
            # another process wrote it first; its copy is the same
    return model, data


def free_run_dir(base: Path) -> Path:
    """runs/demo, or runs/demo-2, ... : an earlier demo run is never overwritten."""
    if not base.exists():
        return base
    n = 2
    while Path(f"{base}-{n}").exists():
        n += 1
    return Path(f"{base}-{n}")


def demo_config(output_dir: Path, *, max_train_steps: int | None = None, resume: bool = False,
                network_type: str = "lora") -> TrainConfig:
    model, data = demo_assets()
    values = read_toml(PRESETS / "demo.toml")
    if network_type != "lora":  # LoHa and LoKr need higher rates than the preset's (config.TOY_DEMO_RATES)
        learning_rate, text_encoder_lr = TOY_DEMO_RATES[network_type]
        values.update(network_type=network_type, learning_rate=learning_rate, text_encoder_lr=text_encoder_lr)
    values.update(pretrained_model_name_or_path=str(model), train_data_dir=str(data),
                  output_dir=str(output_dir if resume else free_run_dir(output_dir)))
    if resume:
        values["resume_from_checkpoint"] = "auto"
    if max_train_steps:
        values["max_train_steps"] = max_train_steps
    return build_config(values)


def make_gallery(run_dir: Path, target: Path | None = None, *, scale: int = 2) -> Path | None:
    """One PNG of the run's validation images: a row per (prompt, seed), a column per sampling step.

    The same prompt and seed in every column, so a row shows one image changing as the LoRA learns.
    """
    import json

    from PIL import ImageFont

    steps = sorted(p for p in (Path(run_dir) / "samples").glob("step_*") if (p / "prompts.json").is_file())
    if not steps:
        return None
    meta = json.loads((steps[0] / "prompts.json").read_text())
    rows = [(p, prompt, seed) for p, prompt in enumerate(meta["prompts"]) for seed in meta["seeds"]]
    with Image.open(steps[0] / f"p00_s{meta['seeds'][0]}.png") as first:
        cell = first.width * scale
    label_w, head_h, pad = 150, 18, 4
    sheet = Image.new("RGB", (label_w + len(steps) * (cell + pad), head_h + len(rows) * (cell + pad)), "white")
    draw = ImageDraw.Draw(sheet)
    font = ImageFont.load_default()
    for c, folder in enumerate(steps):
        draw.text((label_w + c * (cell + pad) + 4, 3), f"step {int(folder.name[5:])}", fill="black", font=font)
    for r, (p, prompt, seed) in enumerate(rows):
        y = head_h + r * (cell + pad)
        draw.text((4, y + cell // 2 - 12), prompt, fill="black", font=font)
        draw.text((4, y + cell // 2 + 2), f"seed {seed}", fill="gray", font=font)
        for c, folder in enumerate(steps):
            path = folder / f"p{p:02d}_s{seed}.png"
            if path.is_file():
                with Image.open(path) as image:
                    sheet.paste(image.convert("RGB").resize((cell, cell), Image.NEAREST),
                                (label_w + c * (cell + pad), y))
    target = target or Path(run_dir) / "gallery.png"
    sheet.save(target)
    return target
