"""Metrics records -> long-format DataFrames (step, value, series) for gr.LinePlot, and their summaries."""
from __future__ import annotations

import math
from typing import Any

import pandas as pd

MAX_POINTS = 1000  # a browser plot gains nothing from more; long runs are thinned evenly
EMA_SPAN = 20  # logged points; smooths per-step noise while still following a falling loss

# plot name -> (title, y axis title, [(metrics key, series label)])
PLOTS: dict[str, tuple[str, str, list[tuple[str, str]]]] = {
    "loss": ("Loss", "loss", [("loss", "loss"), ("loss_ema", "loss (EMA)"), ("val_loss", "validation loss")]),
    # The noise bands on a chart of their own: six entries in the Loss chart's one-row legend ran off its edge.
    "val_noise": ("Validation loss by noise level", "loss", [("val_loss_low_noise", "low noise (t < 250)"),
                                                             ("val_loss_mid_noise", "mid noise (250-750)"),
                                                             ("val_loss_high_noise", "high noise (t ≥ 750)")]),
    "lr": ("Learning rate", "learning rate", [("lr", "learning rate")]),
    "grad": ("Gradient norm", "norm", [("grad_norm", "grad norm"), ("clip_threshold", "clip threshold")]),
    "memory": ("Memory", "MB", [("vram_allocated_mb", "VRAM allocated"), ("vram_reserved_mb", "VRAM reserved"),
                                ("vram_peak_mb", "VRAM peak"), ("ram_mb", "RAM")]),
}


def metrics_frame(metrics: list[dict[str, Any]]) -> pd.DataFrame:
    """One row per logged step; non-numbers (the engine writes NaN/Inf as strings) become NaN."""
    if not metrics:
        return pd.DataFrame({"step": []})
    frame = pd.DataFrame.from_records(metrics)
    for column in frame.columns:
        frame[column] = pd.to_numeric(frame[column], errors="coerce")
    # "inf" parses to a float; a plot cannot draw it (its axis runs to 1.8e308), so it is a gap like NaN.
    frame = frame.replace([math.inf, -math.inf], math.nan)
    frame = frame.dropna(subset=["step"]).drop_duplicates("step", keep="last").sort_values("step")
    if "loss" in frame:
        frame["loss_ema"] = frame["loss"].ewm(span=EMA_SPAN, adjust=True, ignore_na=True).mean()
    return frame


def with_val_loss(frame: pd.DataFrame, records: list[dict[str, Any]] | list[tuple[int, float]]) -> pd.DataFrame:
    """The validation loss of diagnostics/val_loss.jsonl (records with `step`, `val_loss` and maybe its noise
    bands, or (step, value) pairs) beside the training loss, in the columns metrics.jsonl uses for it.

    The engine writes `val_loss` (and its bands) into metrics.jsonl too, on the steps it logs: a value there
    and one from the file are the same measurement, so they fill each other's gaps in one column."""
    if not records:
        return frame
    rows = [r if isinstance(r, dict) else {"step": r[0], "val_loss": r[1]} for r in records]
    val = metrics_frame(rows).drop(columns=["loss_ema"], errors="ignore")
    val = val[[c for c in val.columns if c == "step" or c.startswith("val_loss")]]
    if frame.empty:
        return val
    merged = frame.merge(val, on="step", how="outer", suffixes=("", "__file")).sort_values("step")
    for column in [c for c in merged.columns if c.endswith("__file")]:
        merged[column[:-len("__file")]] = merged[column[:-len("__file")]].combine_first(merged.pop(column))
    return merged.reset_index(drop=True)


def thin(frame: pd.DataFrame, max_points: int = MAX_POINTS) -> pd.DataFrame:
    if len(frame) <= max_points:
        return frame
    stride = -(-len(frame) // max_points)
    # Always keep the newest point: it is the one the user is watching.
    return pd.concat([frame.iloc[::stride], frame.iloc[[-1]]]).drop_duplicates("step")


def plot_frame(frame: pd.DataFrame, plot: str) -> pd.DataFrame:
    """Long format for one plot: the series present in the metrics, NaN rows dropped (a series with no
    finite value at all is left out)."""
    parts = []
    for key, label in PLOTS[plot][2]:
        if key in frame:
            part = frame[["step", key]].rename(columns={key: "value"}).dropna()
            if not part.empty:
                part["series"] = label
                parts.append(part)
    if not parts:
        return pd.DataFrame({"step": pd.Series(dtype=float), "value": pd.Series(dtype=float),
                             "series": pd.Series(dtype=str)})
    return thin(pd.concat(parts, ignore_index=True), MAX_POINTS * len(parts))


def series_of(long: pd.DataFrame) -> tuple[str, ...]:
    """The series a plot frame draws, in a stable order."""
    return tuple(sorted(set(long["series"]))) if len(long) else ()


def plot_update(long: pd.DataFrame, drawn: tuple[str, ...] | None) -> tuple[pd.DataFrame | None, tuple[str, ...] | None]:
    """(value to send to a LinePlot, what the browser then draws), given what it draws now (`drawn`).

    Gradio's LinePlot (5+) builds its Vega spec (axes, colour domain) from the first value it is given and
    afterwards only swaps the data: an empty frame gives a degenerate axis, and a series that was not there
    at build time is never drawn. So an empty frame is sent as None (the plot shows its empty state), and a
    change of the series set goes through None first: the plot is then rebuilt from the next frame.
    """
    series = series_of(long)
    if not series:
        return None, ()
    if drawn and drawn != series:
        return None, ()
    return long, series


def summary(frame: pd.DataFrame) -> str:
    """One line under the plots: how many points, and the newest values."""
    if frame.empty or "loss" not in frame or frame["loss"].isna().all():
        return "No metrics yet: the plots fill in once training logs its first step."
    if frame["loss"].notna().sum() == 1:  # a line needs two points: say what the one point is
        first = frame.dropna(subset=["loss"]).iloc[0]
        return (f"1 logged step · step {int(first['step'])} · loss {first['loss']:.4g} (the charts draw their lines "
                "from the second logged step)")
    last = frame.dropna(subset=["loss"]).iloc[-1]
    parts = [f"{len(frame)} logged steps", f"step {int(last['step'])}", f"loss {last['loss']:.4g}",
             f"EMA {last['loss_ema']:.4g}"]
    for key, name in (("lr", "lr"), ("grad_norm", "grad norm"), ("vram_peak_mb", "VRAM peak MB"),
                      ("ram_mb", "RAM MB")):
        if key in frame and pd.notna(last.get(key)):
            parts.append(f"{name} {last[key]:.4g}")
    if "val_loss" in frame and frame["val_loss"].notna().any():
        best = frame.loc[frame["val_loss"].idxmin()]
        parts.append(f"best validation loss {best['val_loss']:.4g} at step {int(best['step'])}")
    return " · ".join(parts)


def events_frame(events: list[dict[str, Any]], limit: int = 200) -> pd.DataFrame:
    """The guards' decisions, newest first."""
    rows = [{"step": e.get("step") if e.get("step") is not None else "", "kind": e.get("kind", ""),
             "message": e.get("message", "")} for e in reversed(events[-limit:])]
    return pd.DataFrame(rows, columns=["step", "kind", "message"])
