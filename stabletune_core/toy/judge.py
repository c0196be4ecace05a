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

from ..runs.layout import RunPaths, sample_image_name, sample_prompts, step_of
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


def base_folder(run_dir: Path) -> Path | None:
    """The run's step-0 sampling (the base model's own images, what a kept colour's drift is measured against);
    None when the run has none (a resume that lost it, or a run that never sampled at step 0)."""
    folders = sample_folders(run_dir)
    return folders[0] if folders and step_of(folders[0]) == 0 else None


def judge_samples(folder: Path, run_dir: Path | None = None, *,
                  references: dict[str, float] | None = None) -> dict[str, Any]:
    """The measures of one sampling folder of `run_dir` (default: the folder's run, RUN/samples/step_N/):
    {"concept": {colour: mean hue error in degrees against the training images},
     "drift": {colour: mean drift in degrees against the step-0 sampling, same prompt and seed},
     "shapes": fraction of images with their prompt's shape (None when no prompt names a known shape),
     "images": how many images were measured, "expected": how many the sampling should hold (prompts x seeds),
     "unpaired": kept-colour images without their step-0 image (their drift is not measured),
     "no_reference": concept colours without a training image captioned with them (their error is not measured)}.
    `references` ({concept colour: hue}) saves re-reading the training images at every sampling."""
    folder = Path(folder)
    run_dir = Path(run_dir) if run_dir is not None else folder.parent.parent
    images = _sample_images(folder)
    meta = json.loads(sample_prompts(folder).read_text(encoding="utf-8"))
    base = base_folder(run_dir)
    first = _sample_images(base) if base is not None else {}
    references = dict(references or {})
    errors: dict[str, list[float]] = {}
    drifts: dict[str, list[float]] = {}
    learned_shapes: dict[str, list[bool]] = {}
    shapes: list[bool] = []
    unpaired = 0
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
            before = first.get((prompt, seed))
            if before is None:
                unpaired += 1
            else:
                drifts.setdefault(color, []).append(hue_distance(hue, _hue(before)[0]))
    return {"concept": {c: round(_mean(v), 2) for c, v in errors.items()},
            "concept_shapes": {s: round(_mean([float(x) for x in v]), 4) for s, v in learned_shapes.items()},
            "drift": {c: round(_mean(v), 2) for c, v in drifts.items()},
            "shapes": round(_mean([float(s) for s in shapes]), 4) if shapes else None,
            "images": len(images), "expected": len(meta["prompts"]) * len(meta["seeds"]), "unpaired": unpaired,
            "no_reference": sorted(c for c, hue in references.items() if math.isnan(hue))}


def not_measured(measures: dict[str, Any]) -> list[str]:
    """What a verdict would need and `measures` lacks, each as a phrase: every kept colour of the toy base
    (BASE_COLORS) needs its drift against step 0, every concept colour its training images."""
    missing = [f"{c} (no training image captioned {c!r})" for c in measures.get("no_reference", [])]
    kept = [c for c in BASE_COLORS if c not in measures["drift"]]
    if kept:
        missing.append(f"{', '.join(kept)} drift (no validation image with a step-0 image to compare)")
    if not measures["concept"] and not measures.get("concept_shapes") and not measures.get("no_reference"):
        missing.append("the concept (no validation prompt names a colour or shape the base never learned)")
    return missing


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
    """The pass/fail view, with its thresholds in degrees: 'pass' only when everything it needs was measured
    (not_measured); a measure that already fails says 'not yet' whatever else is missing."""
    concept = (f"concept shape right in {_percent(CONCEPT_SHAPE_PASS)} of its images"
               if measures.get("concept_shapes") and not measures["concept"]
               else f"concept within {CONCEPT_PASS_DEG:.0f} deg of its training images")
    rule = f"{concept}, kept colours within {KEPT_PASS_DEG:.0f} deg of the base"
    if not passed(measures):
        return f"not yet ({rule})"
    missing = not_measured(measures)
    if missing:
        return f"no verdict: not measured: {'; '.join(missing)}"
    return f"pass ({rule})"


def images_read(measures: dict[str, Any], step: int) -> str:
    """'read 60 images at step 400 against step 0's' (with what is missing from the sampling or from step 0)."""
    line = f"read {measures['images']} images at step {step}"
    if measures["images"] < measures["expected"]:
        line += f" ({measures['expected'] - measures['images']} of its {measures['expected']} missing)"
    line += " against step 0's"
    if measures["unpaired"]:
        line += f" ({measures['unpaired']} without their step-0 image, not measured)"
    return line


def learning_summary(run_dir: Path) -> str:
    """The run's learning in one line, from its step-0 sampling (the base's own images) to its last (read from
    RUN/samples/): 'purple: 61 deg off -> 4 deg off; kept: red drift 1 deg, ...; shapes 92 %; read 60 images at
    step 400 against step 0's; pass (...)'. A run without a sampling after step 0, or without step 0's images,
    says what is missing instead of a verdict."""
    folders = sample_folders(run_dir)
    if not folders:
        return ""
    base = base_folder(run_dir)
    last = folders[-1]
    if base is None:
        measures = judge_samples(last, run_dir)
        return (f"{describe(measures)}; read {measures['images']} images at step {step_of(last)}; no verdict: the "
                "base's own images (step 0) are missing, so no kept colour's drift was measured")
    if last == base:
        measures = judge_samples(base, run_dir)
        return (f"{describe(measures)}; read {measures['images']} images at step 0 only; no verdict: the run made "
                "no validation images after step 0 (it ended before its first sampling), so nothing it learned "
                "was measured")
    first = judge_samples(base, run_dir)
    measures = judge_samples(last, run_dir)
    return f"{describe(measures, first)}; {images_read(measures, step_of(last))}; {verdict(measures)}"
