"""Monitor tab: live loss (raw + EMA + validation), learning rate, gradient norm vs clip threshold, memory, and the
guards' events."""
from __future__ import annotations

from typing import Any

import gradio as gr

from .. import diagnostics, plots
from ..compat import make, unchanged
from ..context import UIContext

TITLE = "Monitor"
PLOTS = ("loss", "lr", "grad", "memory")


def _plot(ctx: UIContext, name: str) -> None:
    title, y_title, _ = plots.PLOTS[name]
    ctx.parts[f"monitor.{name}"] = make(gr.LinePlot, value=None,
                                        x="step", y="value", color="series", title=title, x_title="step",
                                        y_title=y_title, label=title, show_label=False, color_title="", height=300, tooltip=["step", "value", "series"],
                                        elem_id=f"plot-{name}")


def build(ctx: UIContext) -> None:
    ctx.parts["monitor.summary"] = make(gr.Markdown, value=plots.summary(plots.metrics_frame([])),
                                        elem_id="monitor-summary")
    for pair in (("loss", "lr"), ("grad", "memory")):
        with gr.Row():
            for name in pair:
                with make(gr.Column, min_width=320):
                    _plot(ctx, name)
    ctx.parts["monitor.events"] = make(gr.Dataframe, label="Events (what the guards did and why, newest first)",
                                       headers=["step", "kind", "message"], interactive=False, wrap=True,
                                       elem_id="monitor-events")


def wire(ctx: UIContext) -> None:
    """Everything here is refreshed by the timer; nothing to click."""


def live_outputs(ctx: UIContext) -> list[Any]:
    return [ctx.parts[k] for k in ("monitor.summary", "monitor.loss", "monitor.lr", "monitor.grad", "monitor.memory",
                                   "monitor.events")]


def refresh(ctx: UIContext, seen: dict[str, Any]) -> list[Any]:
    run = ctx.run_of(seen)
    reader = ctx.hub.reader(run) if run else None
    metrics = reader.metrics() if reader else []
    events = reader.events() if reader else []
    val = diagnostics.val_loss_records(reader) if reader else []
    key = (str(run), len(metrics), len(events), len(val))
    if seen.get("monitor") == key:  # nothing new: send nothing, the browser keeps its plots
        return [unchanged()] * 6
    frame = plots.with_val_loss(plots.metrics_frame(metrics), val)
    drawn = seen.setdefault("monitor.series", {})
    values, waiting = [], False
    for name in PLOTS:
        long = plots.plot_frame(frame, name)
        value, drawn[name] = plots.plot_update(long, drawn.get(name))
        values.append(value)
        waiting |= value is None and not long.empty  # cleared for a new series set: data on the next tick
    if not waiting:
        seen["monitor"] = key
    return [plots.summary(frame), *values, plots.events_frame(events)]
