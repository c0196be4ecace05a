"""Measure what a run's validation images learned, in degrees (`sample_judge = "toy_colors"`).

The judge reads a samples folder (images + prompts.json, written by train/validation_images.py) and the run's
own files; it returns what it measured and the loop decides what to log. Prompts are toy-world captions ("a
purple circle"). For each colour word of the prompts:
- a *concept* colour (one the toy base was never taught, e.g. purple): the hue error in degrees of its images
  against the hue measured on the run's own training images captioned with that word;
- a *kept* colour (one the base draws, e.g. red): the drift in degrees of each image against the run's first
  sampling (step 0: the base model's own image) at the same prompt and seed;
- a *concept shape* (one the base never drew, the ring, in a known colour): the fraction drawn in that shape;
and over every image whose prompt names a base shape, the fraction drawn in that shape. The pass/fail view
(for humans) states its thresholds in degrees: CONCEPT_PASS_DEG and KEPT_PASS_DEG (CONCEPT_SHAPE_PASS).
"""
from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any

from PIL import Image

from ..runs.layout import RunPaths, sample_image_name, sample_prompts
from .score import SHAPE_PROTOTYPES, caption_parts, hue_distance, judge, reference_hue
from .world import BASE_COLORS, SHAPES

CONCEPT_PASS_DEG = 8.0  # the concept is learned when its images are this close to its training images' hue
KEPT_PASS_DEG = 3.0  # a kept colour is kept when its images moved no more than this from the base's
CONCEPT_SHAPE_PASS = 0.7  # a concept shape is learned when this fraction of its images show it
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def sample_folders(run_dir: Path) -> list[Path]:
    """The run's sampling folders (RUN/samples/step_NNNNNN with a prompts.json), oldest first."""
    return RunPaths(Path(run_dir)).sample_folders()


def _sample_images(folder: Path) -> dict[tuple[str, int], Path]:
    meta = json.loads(sample_prompts(folder).read_text(encoding="utf-8"))
    images = {}
    for p, prompt in enumerate(meta["prompts"]):
        for seed in meta["seeds"]:
            path = Path(folder) / sample_image_name(p, seed)
            if path.is_file():
                images[(prompt, seed)] = path
    return images


def training_images_in(data: Path, word: str, extension: str = ".txt") -> list[Path]:
    """The images of a dataset folder (searched recursively) whose caption names `word`."""
    found = []
    for image in sorted(p for p in Path(data).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES):
        caption = image.with_suffix(extension)
        if caption.is_file() and word in caption.read_text(encoding="utf-8").lower().split():
            found.append(image)
    return found


def concept_reference_in(data: Path, word: str, extension: str = ".txt") -> float:
    """The hue (degrees) of a dataset's images of the concept `word`; NaN when it has none."""
    images = []
    for path in training_images_in(data, word, extension):
        with Image.open(path) as image:
            images.append(image.convert("RGB"))
    return reference_hue(images)


def concept_reference(run_dir: Path, word: str) -> float:
    """The hue (degrees) of the run's own training images of the concept `word` (its config's train_data_dir);
    NaN when it has none."""
    config = tomllib.loads(RunPaths(Path(run_dir)).config.read_text(encoding="utf-8"))
    data = config.get("train_data_dir") or ""
    if not data or not Path(data).is_dir():
        return math.nan
    return concept_reference_in(Path(data), word, config.get("caption_extension", ".txt"))


def _hue(path: Path) -> tuple[float, str]:
    with Image.open(path) as image:
        verdict = judge(image)
    return verdict.hue, verdict.shape


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def judge_samples(folder: Path, run_dir: Path | None = None, *,
                  references: dict[str, float] | None = None) -> dict[str, Any]:
    """The measures of one sampling folder of `run_dir` (default: the folder's run, RUN/samples/step_N/):
    {"concept": {colour: mean hue error in degrees against the training images},
     "drift": {colour: mean drift in degrees against the first sampling, same prompt and seed},
     "shapes": fraction of images with their prompt's shape (None when no prompt names a known shape),
     "images": how many images were measured}.
    `references` ({concept colour: hue}) saves re-reading the training images at every sampling."""
    folder = Path(folder)
    run_dir = Path(run_dir) if run_dir is not None else folder.parent.parent
    images = _sample_images(folder)
    folders = sample_folders(run_dir)
    first = _sample_images(folders[0]) if folders else images
    references = dict(references or {})
    errors: dict[str, list[float]] = {}
    drifts: dict[str, list[float]] = {}
    learned_shapes: dict[str, list[bool]] = {}
    shapes: list[bool] = []
    for (prompt, seed), path in images.items():
        color, shape = caption_parts(prompt)
        hue, drawn = _hue(path)
        if color not in BASE_COLORS:  # a concept colour: how far from its training images
            if color not in references:
                references[color] = concept_reference(run_dir, color)
            if not math.isnan(references[color]):
                errors.setdefault(color, []).append(hue_distance(hue, references[color]))
            if shape in SHAPES:
                shapes.append(drawn == shape)
        elif shape not in SHAPES:  # a concept shape in a known colour: is it drawn in that shape
            if shape in SHAPE_PROTOTYPES:
                learned_shapes.setdefault(shape, []).append(drawn == shape)
        else:  # the base's own vocabulary: how far it moved from the base's image, and its shape
            shapes.append(drawn == shape)
            base = first.get((prompt, seed))
            if base is not None:
                drifts.setdefault(color, []).append(hue_distance(hue, _hue(base)[0]))
    return {"concept": {c: round(_mean(v), 2) for c, v in errors.items()},
            "concept_shapes": {s: round(_mean([float(x) for x in v]), 4) for s, v in learned_shapes.items()},
            "drift": {c: round(_mean(v), 2) for c, v in drifts.items()},
            "shapes": round(_mean([float(s) for s in shapes]), 4) if shapes else None,
            "images": len(images)}


def passed(measures: dict[str, Any]) -> bool:
    """The human view: every concept colour within CONCEPT_PASS_DEG of its training images, every concept
    shape drawn right in CONCEPT_SHAPE_PASS of its images, and every kept colour within KEPT_PASS_DEG of the
    base."""
    return (all(e <= CONCEPT_PASS_DEG for e in measures["concept"].values())
            and all(f >= CONCEPT_SHAPE_PASS for f in measures.get("concept_shapes", {}).values())
            and all(d <= KEPT_PASS_DEG for d in measures["drift"].values()))


def describe(measures: dict[str, Any], first: dict[str, Any] | None = None) -> str:
    """'purple: 61 deg off -> 4 deg off; kept: red drift 1 deg, green drift 2 deg; shapes 92 %' (with `first`,
    the concept's error at the first sampling comes before the arrow)."""
    parts = []
    for shape, right in measures.get("concept_shapes", {}).items():
        before = (first or {}).get("concept_shapes", {}).get(shape)
        parts.append(f"{shape}: {_percent(before)} -> {_percent(right)} drawn as a {shape}" if before is not None
                     else f"{shape}: {_percent(right)} drawn as a {shape}")
    for color, error in measures["concept"].items():
        before = (first or {}).get("concept", {}).get(color)
        parts.append(f"{color}: {before:.0f} deg off -> {error:.0f} deg off" if before is not None
                     else f"{color}: {error:.0f} deg off")
    if measures["drift"]:
        parts.append("kept: " + ", ".join(f"{c} drift {d:.0f} deg" for c, d in measures["drift"].items()))
    if measures["shapes"] is not None:
        parts.append(f"shapes {_percent(measures['shapes'])}")
    return "; ".join(parts)


def _percent(fraction: float) -> str:
    return f"{fraction:.0%}".replace("%", " %")


def verdict(measures: dict[str, Any]) -> str:
    """The pass/fail view, with its thresholds in degrees."""
    concept = (f"concept shape right in {_percent(CONCEPT_SHAPE_PASS)} of its images"
               if measures.get("concept_shapes") and not measures["concept"]
               else f"concept within {CONCEPT_PASS_DEG:.0f} deg of its training images")
    rule = f"{concept}, kept colours within {KEPT_PASS_DEG:.0f} deg of the base"
    return f"pass ({rule})" if passed(measures) else f"not yet ({rule})"


def learning_summary(run_dir: Path) -> str:
    """The run's learning in one line, from its first sampling to its last (read from RUN/samples/):
    'purple: 61 deg off -> 4 deg off; kept: red drift 1 deg, green drift 2 deg; shapes 92 %; pass (...)'."""
    folders = sample_folders(run_dir)
    if not folders:
        return ""
    first = judge_samples(folders[0], run_dir)
    last = judge_samples(folders[-1], run_dir)
    return f"{describe(last, first)}; {verdict(last)}"
