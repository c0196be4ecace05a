"""LoRA singular-value spectra over training: a heatmap per module, effective rank per module, warnings.

The diagnostics work fills RUN/diagnostics/*.jsonl; until then this reads whatever exists. Records read:
{"step": int, "module": str, "singular_values": [float, ...], "effective_rank": float (optional)}
(`sv` or `spectrum` are accepted for the values). Collapse warnings are events whose kind mentions
"collapse" or "rank", plus records of diagnostics/warnings.jsonl.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from matplotlib.figure import Figure  # the object API: no pyplot, no GUI backend, thread-safe enough

from stabletune_core.runs.reader import RunReader

SPECTRA_FILE = "spectra.jsonl"
WARNINGS_FILE = "warnings.jsonl"


def singular_values(record: dict[str, Any]) -> list[float]:
    for key in ("singular_values", "sv", "spectrum"):
        if isinstance(record.get(key), list):
            return [float(v) for v in record[key] if isinstance(v, (int, float))]
    return []


def effective_rank(values: list[float]) -> float:
    """exp(entropy) of the normalised spectrum (Roy & Vetterli): 1 = collapsed to one direction."""
    s = np.asarray([v for v in values if v > 0], dtype=float)
    if s.size == 0:
        return 0.0
    p = s / s.sum()
    return float(math.exp(-(p * np.log(p)).sum()))


def spectra(reader: RunReader) -> list[dict[str, Any]]:
    records = []
    for record in reader.diagnostics(SPECTRA_FILE):
        values = singular_values(record)
        if values and "module" in record and "step" in record:
            rank = record.get("effective_rank")
            records.append({"step": int(record["step"]), "module": str(record["module"]), "sv": values,
                            "effective_rank": float(rank) if isinstance(rank, (int, float)) else effective_rank(values)})
    return records


def modules(records: list[dict[str, Any]]) -> list[str]:
    return sorted({r["module"] for r in records})


def heatmap(records: list[dict[str, Any]], module: str | None) -> Figure | None:
    """Singular values (log10) of one module: x = step, y = index of the singular value."""
    rows = sorted((r for r in records if r["module"] == module), key=lambda r: r["step"])
    if not rows:
        return None
    width = max(len(r["sv"]) for r in rows)
    grid = np.full((width, len(rows)), np.nan)
    for col, r in enumerate(rows):
        grid[: len(r["sv"]), col] = np.log10(np.maximum(r["sv"], 1e-12))
    figure = Figure(figsize=(8, 3.5), layout="constrained")
    axes = figure.add_subplot()
    image = axes.imshow(grid, aspect="auto", origin="lower", interpolation="nearest", cmap="viridis",
                        extent=(rows[0]["step"], rows[-1]["step"] or 1, -0.5, width - 0.5))
    figure.colorbar(image, ax=axes, label="log10 singular value")
    axes.set(title=f"Singular values of {module}", xlabel="step", ylabel="index")
    return figure


def rank_lines(records: list[dict[str, Any]], limit: int = 12) -> Figure | None:
    """Effective rank over steps for the modules whose rank fell the most (the ones to worry about)."""
    by_module: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        by_module.setdefault(r["module"], []).append((r["step"], r["effective_rank"]))
    if not by_module:
        return None
    drop = {m: sorted(v)[0][1] - sorted(v)[-1][1] for m, v in by_module.items()}
    figure = Figure(figsize=(8, 3.5), layout="constrained")
    axes = figure.add_subplot()
    for module in sorted(drop, key=drop.get, reverse=True)[:limit]:
        points = sorted(by_module[module])
        axes.plot([p[0] for p in points], [p[1] for p in points], label=module, linewidth=1.2)
    axes.set(title="Effective rank per module", xlabel="step", ylabel="effective rank")
    axes.legend(fontsize="x-small", loc="best")
    return figure


def warnings(reader: RunReader) -> list[list[Any]]:
    rows = [[e.get("step", ""), e.get("kind", ""), e.get("message", "")] for e in reader.events()
            if any(word in str(e.get("kind", "")) for word in ("collapse", "rank"))]
    rows += [[w.get("step", ""), w.get("kind", "warning"), w.get("message", "")]
             for w in reader.diagnostics(WARNINGS_FILE)]
    return rows


def available(reader: RunReader) -> list[str]:
    folder = reader.paths.diagnostics
    return sorted(p.name for p in folder.glob("*.jsonl")) if folder.is_dir() else []
