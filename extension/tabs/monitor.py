"""Monitor tab: live loss (raw + EMA + validation), learning rate, gradient norm vs clip threshold, memory, and the
guards' events."""
from __future__ import annotations

from typing import Any

import gradio as gr

from .. import diagnostics, plots
from ..compat import make, unchanged
from ..context import UIContext
from ..status import run_status

TITLE = "Monitor"
PLOTS = ("loss", "lr", "grad", "memory", "val_noise")


def _plot(ctx: UIContext, name: str) -> None:
    title, y_title, _ = plots.PLOTS[name]
    ctx.parts[f"monitor.{name}"] = make(gr.LinePlot, value=None,
                                        x="step", y="value", color="series", title=title, x_title="step",
                                        y_title=y_title, label=title, show_label=False, color_title="", height=300, tooltip=["step", "value", "series"],
                                        elem_id=f"plot-{name}")


def build(ctx: UIContext) -> None:
    ctx.parts["monitor.summary"] = make(gr.Markdown, value=plots.summary(plots.metrics_frame([])),
                                        elem_id="monitor-summary")
    for pair in (("loss", "lr"), ("grad", "memory"), ("val_noise",)):
        with gr.Row():
            for name in pair:
                with make(gr.Column, min_width=320):
                    _plot(ctx, name)
    # Fixed widths for step and kind, the rest for the message, which wraps (whole, never cut).
    ctx.parts["monitor.events"] = make(gr.Dataframe, label="Events (what the guards did and why, newest first)",
                                       headers=["step", "kind", "message"], interactive=False, wrap=True,
                                       column_widths=["8%", "14%", "78%"], elem_id="monitor-events",
                                       elem_classes=["stabletune-events"])


def wire(ctx: UIContext) -> None:
    """Everything here is refreshed by the timer; nothing to click."""


def live_outputs(ctx: UIContext) -> list[Any]:
    return [ctx.parts[k] for k in ("monitor.summary", *(f"monitor.{name}" for name in PLOTS), "monitor.events")]


def refresh(ctx: UIContext, seen: dict[str, Any]) -> list[Any]:
    run = ctx.run_of(seen)
    reader = ctx.hub.reader(run) if run else None
    metrics = reader.metrics() if reader else []
    events = reader.events() if reader else []
    val = diagnostics.val_loss_records(reader) if reader else []
    waiting = waiting_note(run_status(ctx.hub, run)[0], trained=bool(metrics)) if reader else ""
    key = (str(run), len(metrics), len(events), len(val), waiting)
    if seen.get("monitor") == key:  # nothing new: send nothing, the browser keeps its plots
        return [unchanged()] * (len(PLOTS) + 2)
    frame = plots.with_val_loss(plots.metrics_frame(metrics), val)
    drawn = seen.setdefault("monitor.series", {})
    values, cleared = [], False
    for name in PLOTS:
        long = plots.plot_frame(frame, name)
        value, drawn[name] = plots.plot_update(long, drawn.get(name))
        values.append(value)
        cleared |= value is None and not long.empty  # cleared for a new series set: data on the next tick
    if not cleared:
        seen["monitor"] = key
    return [plots.summary(frame) + waiting, *values, plots.events_frame(events)]


def waiting_note(status: dict[str, Any], *, trained: bool = False) -> str:
    """What a live run does before its first logged step, so empty charts are not a mystery, and which
    validation images it is making (the step-0 ones are made between training steps)."""
    if not status.get("alive"):
        return ""
    state, images = status.get("state"), status.get("images")
    if state == "sampling" and images:
        sampled = status.get("sampling_step", status.get("step")) or 0
        return (f" The engine is making the step-{sampled} validation images ({images[0]} of {images[1]})"
                + ("." if trained else " before it trains."))
    if trained:
        return ""
    doing = {"launching": "starting", "starting": "starting", "loading": "loading the model",
             "caching": "caching latents and captions", "training": "training its first step"}.get(state)
    return f" The engine is {doing}." if doing else ""
