"""Validation images laid out for comparison: one row per step, one column per prompt/seed, as an HTML table."""
from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Callable

from stabletune_core.runs import events as kinds
from stabletune_core.runs.layout import sample_image_place, sample_prompts
from stabletune_core.runs.reader import RunReader

ALL = "All prompts, one row per step"


def _prompts(step_folder: Path) -> list[str]:
    try:
        return list(json.loads(sample_prompts(step_folder).read_text(encoding="utf-8")).get("prompts", []))
    except (OSError, ValueError):
        return []


def describe(image: Path) -> tuple[str, str]:
    """(key, label) of a sample image: key 'p00_s42' is the same prompt and seed at every step."""
    key = image.stem
    place = sample_image_place(key)
    if place is None:
        return key, key
    prompts = _prompts(image.parent)
    index, seed = place
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


THUMB = 160  # px: the widest an image is shown in the table (a click opens it whole)


def grid_html(reader: RunReader, view: str, url: Callable[[Path], str]) -> str:
    """The validation images as an HTML table: one row per step (newest first), one column per prompt and seed,
    each column headed by its whole prompt and seed, each row by its step. One key: that image at every step,
    in one row. `url` turns an image path into the address the browser loads it from (compat.file_url)."""
    steps = list(reversed(reader.sample_steps()))
    if not steps:
        return grid_html_empty()
    if view and view != ALL:
        key = view.split(":", 1)[0]
        cells = [(step, img) for step, images in steps for img in images if img.stem == key]
        heads = "".join(f"<th>step {step}</th>" for step, _ in cells)
        row = "".join(f"<td>{_image(url, img, f'step {step} · {describe(img)[1]}')}</td>" for step, img in cells)
        title = html.escape(describe(cells[0][1])[1]) if cells else ""
        return _table(f"<caption>{title}</caption><tr>{heads}</tr><tr>{row}</tr>", len(cells), header=False)
    keys: dict[str, str] = {}
    for _, images in steps:
        for img in images:
            keys.setdefault(img.stem, describe(img)[1])
    order = sorted(keys)
    head = '<tr><th class="step"></th>' + "".join(f"<th>{html.escape(keys[k])}</th>" for k in order) + "</tr>"
    rows = []
    measures = judged(reader)
    for step, images in steps:
        by_key = {img.stem: img for img in images}
        cells = "".join(f"<td>{_image(url, by_key[k], f'step {step} · {keys[k]}') if k in by_key else ''}</td>"
                        for k in order)
        rows.append(f'<tr><th scope="row" class="step">step {step}</th>{cells}</tr>')
        if step in measures:  # a line of its own under the step's images: in the 82 px step label it ran out of
            rows.append(f'<tr class="judge"><td></td><td colspan="{len(order)}"><small class="judge">'  # its cell
                        f'{html.escape(measures[step])}</small></td></tr>')  # under the images (issue 37.8)
    return _table(head + "".join(rows), len(order), header=True)


def grid_html_empty() -> str:
    return '<p class="stabletune-empty">No validation images yet: they appear here after the first sampling.</p>'


def _image(url: Callable[[Path], str], path: Path, caption: str) -> str:
    address, text = html.escape(url(path), quote=True), html.escape(caption, quote=True)
    return f'<a href="{address}" target="_blank"><img src="{address}" alt="{text}" title="{text}" loading="lazy"></a>'


def _table(body: str, columns: int, *, header: bool) -> str:
    """A table no wider than its images need (THUMB px each, plus the step column), shrinking to the page."""
    width = columns * (THUMB + 8) + (90 if header else 0)
    return (f'<div class="stabletune-samples"><table style="width: min(100%, {width}px)">{body}</table></div>')


def signature(reader: RunReader) -> tuple:
    """Changes when a new step's images land, or the judge's measures of them; the refresh sends the gallery
    only then."""
    return (tuple((step, len(images)) for step, images in reader.sample_steps()), tuple(judged(reader)))


def judged(reader: RunReader) -> dict[int, str]:
    """{step: the sample judge's measures of that step's images} ('purple: 12 deg off; kept: red drift 1 deg;
    shapes 92 %'), from the run's `sample_score` events; empty for a run without a judge."""
    return {int(e["step"]): str(e["line"]) for e in reader.events()
            if e.get("kind") == kinds.SAMPLE_SCORE and "line" in e and "step" in e}
