"""Judge a run's validation images with the toy world's colour judge (`sample_judge = "toy_colors"`).

An observer: it reads a samples folder (images + prompts.json, written by train/sampling.py) and returns
what it saw; the loop decides what to log. Prompts are toy-world captions ("a purple circle"): an image
scores when its object has the prompt's colour. Scores are grouped by colour word, so a demo reports the
concept ("purple") separately from the base colours it must not wreck.
"""
from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from .score import caption_parts, judge


def judge_samples(folder: Path) -> dict[str, float]:
    """{colour word: fraction of that colour's validation images showing it} for one sampling folder."""
    meta = json.loads((Path(folder) / "prompts.json").read_text())
    hits: dict[str, list[bool]] = {}
    for p, prompt in enumerate(meta["prompts"]):
        color = caption_parts(prompt)[0]
        for seed in meta["seeds"]:
            path = Path(folder) / f"p{p:02d}_s{seed}.png"
            if path.is_file():
                with Image.open(path) as image:
                    hits.setdefault(color, []).append(judge(image).color == color)
    return {color: sum(v) / len(v) for color, v in hits.items()}


def learning_summary(first: dict[str, float], last: dict[str, float]) -> str:
    """'purple 0 % -> 83 %, red 100 % -> 100 %': the first and the last sampling, colour by colour."""
    return ", ".join(f"{color} {first.get(color, 0):.0%} -> {last[color]:.0%}".replace("%", " %")
                     for color in last)
