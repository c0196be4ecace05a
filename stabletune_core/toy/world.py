"""The toy world: coloured shapes on pale backgrounds, drawn procedurally, with plain captions.

The toy base model (see build.py) learns this world, minus one colour: that held-out colour is the
*concept* a LoRA has to teach it. Everything is a pure function of a seed, so a dataset, a test and the
shipped model's build agree image for image.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

#: Colours the base model learns, and the one it never sees (the concept a LoRA teaches). The hues are
#: spread so that no blend of two base colours looks like the concept: the concept's hue neighbours are
#: red and cyan, and their blend is grey, not purple.
BASE_COLORS: dict[str, tuple[int, int, int]] = {
    "red": (215, 35, 35),
    "yellow": (225, 200, 30),
    "green": (40, 165, 55),
    "cyan": (30, 185, 200),
}
CONCEPT_COLOR = "purple"
CONCEPT_RGB = (135, 45, 200)
ALL_COLORS = {**BASE_COLORS, CONCEPT_COLOR: CONCEPT_RGB}
SHAPES = ("circle", "square", "triangle")
#: The shape the base model never sees (the VAE does, so the codec can draw it): the shape concept a LoRA
#: teaches (`demo --concept shape`), which shows a LoRA learns structure, not only tint.
CONCEPT_SHAPE = "ring"
ALL_SHAPES = (*SHAPES, CONCEPT_SHAPE)
#: Shapes neither the base nor its VAE ever saw (bench/concept_suite.py teaches them): a plus sign and a triangle
#: standing on its apex. The toy judge reads them only where asked (score.UNSEEN_SHAPE_PROTOTYPES), so every other
#: measure keeps its four shapes.
UNSEEN_SHAPES = ("cross", "wedge")
CROSS_ARM = 0.3  # the cross's arm half-width, as a fraction of its radius
RING_HOLE = 0.55  # the ring's hole, as a fraction of its radius
IMAGE_SIZE = 64


@dataclass(frozen=True)
class Scene:
    color: str
    shape: str
    seed: int
    rgb: tuple[int, int, int] | None = None  # a colour outside the palette (the VAE's training images)

    @property
    def caption(self) -> str:
        return f"a {self.color} {self.shape}"


def draw_scene(scene: Scene, size: int = IMAGE_SIZE) -> Image.Image:
    """One shape of one colour on a pale, slightly tinted background; position and size vary with the seed."""
    rng = random.Random(scene.seed)
    background = tuple(rng.randint(205, 245) for _ in range(3))
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    radius = rng.randint(size * 13 // 64, size * 20 // 64)
    margin = radius + size // 32
    cx, cy = rng.randint(margin, size - margin), rng.randint(margin, size - margin)
    jitter = rng.randint(-12, 12)
    color = tuple(max(0, min(255, c + jitter)) for c in scene.rgb or ALL_COLORS[scene.color])
    box = (cx - radius, cy - radius, cx + radius, cy + radius)
    if scene.shape == "circle":
        draw.ellipse(box, fill=color)
    elif scene.shape == "square":
        side = int(radius * 0.9)
        draw.rectangle((cx - side, cy - side, cx + side, cy + side), fill=color)
    elif scene.shape == CONCEPT_SHAPE:
        draw.ellipse(box, fill=color)
        hole = int(radius * RING_HOLE)
        draw.ellipse((cx - hole, cy - hole, cx + hole, cy + hole), fill=background)
    elif scene.shape == "cross":
        arm = int(radius * CROSS_ARM)
        draw.rectangle((cx - radius, cy - arm, cx + radius, cy + arm), fill=color)
        draw.rectangle((cx - arm, cy - radius, cx + arm, cy + radius), fill=color)
    elif scene.shape == "wedge":
        draw.polygon([(cx - radius, cy - radius), (cx + radius, cy - radius), (cx, cy + radius)], fill=color)
    else:
        draw.polygon([(cx, cy - radius), (cx - radius, cy + radius), (cx + radius, cy + radius)], fill=color)
    return image


def base_scenes(count: int, seed: int = 0) -> list[Scene]:
    """`count` scenes cycling through every base colour x shape, each with its own drawing seed."""
    combos = [(c, s) for c in BASE_COLORS for s in SHAPES]
    return [Scene(*combos[i % len(combos)], seed=seed * 1_000_003 + i) for i in range(count)]


def concept_scenes(count: int, seed: int = 1) -> list[Scene]:
    """Scenes of the held-out colour, cycling through the shapes."""
    return [Scene(CONCEPT_COLOR, SHAPES[i % len(SHAPES)], seed=seed * 1_000_003 + 500_000 + i) for i in range(count)]


def shape_concept_scenes(count: int, seed: int = 2) -> list[Scene]:
    """Scenes of the held-out shape in the base colours (the base knows the colours, not the shape)."""
    colors = list(BASE_COLORS)
    return [Scene(colors[i % len(colors)], CONCEPT_SHAPE, seed=seed * 1_000_003 + 700_000 + i) for i in range(count)]


def write_dataset(folder: Path, scenes: list[Scene], *, size: int = IMAGE_SIZE) -> Path:
    """PNG + same-name .txt caption per scene. Refuses to write into a folder that already has images."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for i, scene in enumerate(scenes):
        stem = f"{scene.color}_{scene.shape}_{i:03d}"
        draw_scene(scene, size).save(folder / f"{stem}.png")
        (folder / f"{stem}.txt").write_text(scene.caption)
    return folder


def base_prompts() -> list[str]:
    """Every caption of the base vocabulary: what the base model must draw."""
    return [f"a {c} {s}" for c in BASE_COLORS for s in SHAPES]


def concept_prompts(color: str = CONCEPT_COLOR) -> list[str]:
    """The concept colour (default: the demo's) in every base shape."""
    return [f"a {color} {s}" for s in SHAPES]


def shape_concept_prompts() -> list[str]:
    """The held-out shape in every base colour."""
    return [f"a {c} {CONCEPT_SHAPE}" for c in BASE_COLORS]
