"""Validation images laid out for comparison: one row per step, one column per prompt/seed."""
from __future__ import annotations

import json
import re
from pathlib import Path

from stabletune_core.runs.reader import RunReader

ALL = "All prompts, one row per step"
_NAME = re.compile(r"^p(\d+)_s(-?\d+)$")


def _prompts(step_folder: Path) -> list[str]:
    try:
        return list(json.loads((step_folder / "prompts.json").read_text(encoding="utf-8")).get("prompts", []))
    except (OSError, ValueError):
        return []


def describe(image: Path) -> tuple[str, str]:
    """(key, label) of a sample image: key 'p00_s42' is the same prompt and seed at every step."""
    key = image.stem
    match = _NAME.match(key)
    if not match:
        return key, key
    prompts = _prompts(image.parent)
    index, seed = int(match.group(1)), match.group(2)
    prompt = prompts[index] if index < len(prompts) else f"prompt {index + 1}"
    return key, f"{prompt} · seed {seed}"


def choices(reader: RunReader) -> list[str]:
    """ALL, then one entry per prompt/seed ('p00_s42: a red circle · seed 42')."""
    seen: dict[str, str] = {}
    for _, images in reader.sample_steps():
        for image in images:
            key, label = describe(image)
            seen.setdefault(key, f"{key}: {label}")
    return [ALL, *seen.values()]


def gallery(reader: RunReader, view: str = ALL) -> tuple[list[tuple[str, str]], int]:
    """(items, columns), newest step first (the images the user is waiting for). ALL: rows are steps,
    columns prompts x seeds, so each column is one prompt and seed over time. One key: that image at
    every step, side by side. Every image is captioned with its step, prompt and seed."""
    steps = list(reversed(reader.sample_steps()))
    if view and view != ALL:
        key = view.split(":", 1)[0]
        items = [(str(img), f"step {step} · {describe(img)[1]}") for step, images in steps for img in images
                 if img.stem == key]
        return items, max(1, min(len(items), 6))
    items = [(str(img), f"step {step} · {describe(img)[1]}") for step, images in steps for img in images]
    columns = max((len(images) for _, images in steps), default=1)
    return items, max(1, min(columns, 8))


def signature(reader: RunReader) -> tuple:
    """Changes when a new step's images land; the refresh sends the gallery only then."""
    return tuple((step, len(images)) for step, images in reader.sample_steps())
