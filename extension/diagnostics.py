"""What the engine's observers recorded, as figures: singular-value spectra (a heatmap per module), the
effective rank of every module (module x step heatmap), activation statistics (module x step heatmap),
the validation loss with early stopping's best and triggers, and collapse warnings.

Records read from RUN/diagnostics/ (spectra.jsonl, activations.jsonl, val_loss.jsonl); spectra records:
{"step": int, "module": str, "singular_values": [float, ...], "effective_rank": float (optional)}
(`sv` or `spectrum` are accepted for the values). Collapse warnings are events whose kind mentions
"collapse" or "rank", plus records of diagnostics/warnings.jsonl.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from matplotlib.figure import Figure  # the object API: no pyplot, no GUI backend, thread-safe enough

from stabletune_core.runs import events as kinds
from stabletune_core.runs.layout import ACTIVATIONS_FILE, SPECTRA_FILE, VAL_LOSS_FILE, WARNINGS_FILE
from stabletune_core.runs.reader import RunReader

ACTIVATION_STATS = {"var": "variance", "mean": "mean", "zero_fraction": "zero fraction"}


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
    image = axes.pcolormesh(step_edges([r["step"] for r in rows]), np.arange(width + 1) - 0.5,
                            np.ma.masked_invalid(grid), cmap="viridis")
    figure.colorbar(image, ax=axes, label="log10 singular value")
    axes.set(title=f"Singular values of {module}", xlabel="step", ylabel="index")
    return figure


def step_edges(steps: list[int]) -> np.ndarray:
    """Column edges for measurements at `steps`, which need not be evenly spaced (the last one is where the run
    ended): halfway between neighbours, and the axis runs from the first step to the last, not past them. A
    single step gets a column one step wide."""
    steps = sorted(set(steps))
    if len(steps) == 1:
        return np.array([steps[0] - 0.5, steps[0] + 0.5])
    middle = [(a + b) / 2 for a, b in zip(steps, steps[1:])]
    return np.array([steps[0], *middle, steps[-1]], dtype=float)


def module_grid(records: list[dict[str, Any]], value: str, title: str, label: str,
                cmap: str = "viridis") -> Figure | None:
    """A module x step heatmap of `value`: every module readable, however many (one row each, the figure
    grows with them), no legend over the data."""
    rows = [r for r in records if isinstance(r.get(value), (int, float)) and "module" in r and "step" in r]
    if not rows:
        return None
    names = sorted({r["module"] for r in rows})
    steps = sorted({int(r["step"]) for r in rows})
    grid = np.full((len(names), len(steps)), np.nan)
    for r in rows:
        grid[names.index(r["module"]), steps.index(int(r["step"]))] = float(r[value])
    figure = Figure(figsize=(9, 1.2 + 0.16 * len(names)), layout="constrained")
    axes = figure.add_subplot()
    image = axes.pcolormesh(step_edges(steps), np.arange(len(names) + 1) - 0.5, np.ma.masked_invalid(grid),
                            cmap=cmap)
    axes.invert_yaxis()  # the first module on top, as it is listed
    axes.set_yticks(range(len(names)), [short_name(n) for n in names], fontsize=6)
    figure.colorbar(image, ax=axes, label=label)
    axes.set(title=title, xlabel="step")
    return figure


def short_name(module: str) -> str:
    """'unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q' -> 'down1.att0.tb0.attn1.to_q'."""
    for long, short in (("unet.", ""), ("_blocks.", ""), ("attentions.", "att"), ("transformer_", "t"),
                        ("blocks.", "b"), ("base_model.model.", "")):
        module = module.replace(long, short)
    return module


def rank_heatmap(records: list[dict[str, Any]]) -> Figure | None:
    """Effective rank of every module over steps."""
    return module_grid(records, "effective_rank", "Effective rank per module (dark = collapsing)", "effective rank")


def activations(reader: RunReader) -> list[dict[str, Any]]:
    return [r for r in reader.diagnostics(ACTIVATIONS_FILE) if "module" in r and "step" in r]


def activation_heatmap(records: list[dict[str, Any]], stat: str = "var") -> Figure | None:
    return module_grid(records, stat, f"Activation {ACTIVATION_STATS.get(stat, stat)} per module", stat,
                       cmap="magma")


def val_loss_records(reader: RunReader) -> list[dict[str, Any]]:
    """diagnostics/val_loss.jsonl: {"step", "val_loss"} and, where the engine measures them, its noise bands
    (`val_loss_low_noise`, `val_loss_mid_noise`, `val_loss_high_noise`)."""
    return [{k: v for k, v in r.items() if k == "step" or k.startswith("val_loss")}
            for r in reader.diagnostics(VAL_LOSS_FILE) if isinstance(r.get("step"), int)]


def val_loss_points(reader: RunReader) -> list[tuple[int, float]]:
    points = []
    for r in reader.diagnostics(VAL_LOSS_FILE):
        value = r.get("val_loss")
        if isinstance(r.get("step"), int) and isinstance(value, (int, float)) and math.isfinite(value):
            points.append((r["step"], float(value)))
    return sorted(points)


def early_stopping_marks(reader: RunReader) -> tuple[list[int], list[int]]:
    """(steps of early-stopping triggers, step of the early stop) from the events."""
    triggers = [e["step"] for e in reader.events() if e.get("kind") == kinds.EARLY_STOPPING_TRIGGER and e.get("step")]
    stops = [e["step"] for e in reader.events() if e.get("kind") == kinds.EARLY_STOP and e.get("step")]
    return triggers, stops


def val_loss_figure(reader: RunReader) -> Figure | None:
    """Validation loss over steps, its best point, and the steps where early stopping triggered."""
    points = val_loss_points(reader)
    if not points:
        return None
    figure = Figure(figsize=(8, 3.2), layout="constrained")
    axes = figure.add_subplot()
    axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label="validation loss")
    best = min(points, key=lambda p: p[1])
    axes.scatter([best[0]], [best[1]], s=60, color="#5cb85c", zorder=3, label=f"best {best[1]:.4g} (step {best[0]})")
    triggers, stops = early_stopping_marks(reader)
    for i, step in enumerate(triggers):
        axes.axvline(step, color="#f0ad4e", linestyle="--", linewidth=1, label="early-stopping trigger" if i == 0 else None)
    for step in stops:
        axes.axvline(step, color="#d9534f", linewidth=1.5, label="early stop")
    axes.set(title="Validation loss", xlabel="step", ylabel="loss")
    axes.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the data, not on it
    return figure


def rank_lines(records: list[dict[str, Any]], limit: int = 12) -> Figure | None:
    """Kept for callers of the old name: the effective rank of every module as a heatmap."""
    return rank_heatmap(records)


def warnings(reader: RunReader) -> list[list[Any]]:
    rows = [[e.get("step", ""), e.get("kind", ""), e.get("message", "")] for e in reader.events()
            if any(word in str(e.get("kind", "")) for word in ("collapse", "rank"))]
    rows += [[w.get("step", ""), w.get("kind", "warning"), w.get("message", "")]
             for w in reader.diagnostics(WARNINGS_FILE)]
    return rows


def available(reader: RunReader) -> list[str]:
    folder = reader.paths.diagnostics
    return sorted(p.name for p in folder.glob("*.jsonl")) if folder.is_dir() else []
