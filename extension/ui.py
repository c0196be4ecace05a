"""build_ui(settings) -> gr.Blocks: the whole StableTune UI, for app.py and for a WebUI's on_ui_tabs."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import gradio as gr

from . import compat, persist
from .context import UIContext
from .form import Form
from .schema import load_schema
from .session import RunHub
from .settings import UISettings
from .tabs import dataset, diagnostics, model, monitor, queue, runs, samples, tools, train
from stabletune_core import runqueue

DEMO_TEXT = ("**New here? Try the demo:** a tiny model that draws coloured shapes learns a colour it has never seen "
             "(purple) from 12 drawn pictures, in about two minutes on a CPU, with nothing to download. The button "
             "fills in the form; then click **Start training** in the Train tab.")
TABS = (dataset, model, train, queue, monitor, samples, diagnostics, runs, tools)
LIVE_TABS = (train, queue, monitor, samples, diagnostics, runs)
TITLE = "StableTune: LoRA training"
# The page's own rules (field errors, sample rows, tables): given to gr.Blocks on Gradio 3/4 and to launch() on
# Gradio 6 (app.py), which moved it there; a WebUI also loads this file by itself.
STYLE = (Path(__file__).resolve().parent.parent / "style.css").read_text(encoding="utf-8")


def build_ui(settings: UISettings | None = None) -> gr.Blocks:
    settings = settings or UISettings()
    settings.runs_dir.mkdir(parents=True, exist_ok=True)
    groups, fields = load_schema()
    ctx = UIContext(settings=settings, hub=RunHub(settings.runs_dir), form=Form(fields), groups=groups)
    ctx.hub.attach_default()
    with compat.make(gr.Blocks, title=TITLE, analytics_enabled=False, css=STYLE) as blocks:
        gr.Markdown(f"## {TITLE}\nRuns are saved in `{settings.runs_dir}`. Training runs in its own process: "
                    "closing this page or restarting the UI does not stop it.")
        with gr.Row(equal_height=True):  # what a first-time user needs first: a run that works, no download
            ctx.parts["demo.try"] = compat.make(gr.Button, value="▶ Try the demo", variant="primary", scale=1,
                                                elem_id="try-demo")
            ctx.parts["demo.message"] = compat.make(gr.Markdown, value=DEMO_TEXT, elem_id="demo-message")
        with compat.make(gr.Tabs, elem_id="stabletune-tabs"):
            for tab in TABS:
                with make_tab(tab.TITLE):
                    tab.build(ctx)
        # Events are wired once every tab exists: tabs use each other's components (the form is everywhere).
        for tab in TABS:
            tab.wire(ctx)
        after_restore = persist.wire(blocks, ctx)
        _live(ctx, after_restore)
    blocks.stabletune_context = ctx  # for tests and hosts; Blocks accepts new attributes
    return blocks


def make_tab(title: str) -> Any:
    return compat.make(gr.Tab, label=title, elem_id="tab-" + title.split()[0].lower())


def follow_queue(ctx: UIContext, state: dict[str, Any], run: Path | None) -> Path | None:
    """`run`, or the queue's next run: a page that followed a queue run while it trained follows the queue on to
    the run it starts next. A run chosen by hand afterwards is left alone."""
    running = runqueue.read_for_display(ctx.settings.runs_dir)[0].running()
    now = Path(running.run) if running is not None and running.run else None
    followed = Path(state["queue_run"]) if state.get("queue_run") else None
    if now is not None and followed is not None and run == followed and now != followed:
        run = now  # the run this page watched has ended and the queue moved on
    if now is not None and run == now:
        state["queue_run"] = str(now)
    return run


def _live(ctx: UIContext, after_restore: Any) -> None:
    """One periodic refresh for every live tab; a per-browser `seen` state lets each tab skip sending
    what the browser already shows. Each browser follows its own run: the one its Train dropdown shows
    (`seen["run"]`), else the newest run this UI started or found."""
    seen = gr.State({})
    inputs = [seen, ctx.parts["train.run"]]
    outputs: list[Any] = []
    spans = []
    for tab in LIVE_TABS:
        extra = tab.live_inputs(ctx) if hasattr(tab, "live_inputs") else []
        spans.append((tab, len(inputs), len(extra)))
        inputs.extend(extra)
        outputs.extend(tab.live_outputs(ctx))

    def refresh(state: dict[str, Any], label: str | None, *values: Any) -> list[Any]:
        state = dict(state or {})
        state["label"] = label  # what this browser's run dropdown shows now
        state["run"] = follow_queue(ctx, state, ctx.followed(label))
        result: list[Any] = []
        for tab, start, count in spans:
            result.extend(tab.refresh(ctx, state, *values[start - 2:start - 2 + count]))
        return [*result, state]

    # First paint once the browser's saved run and form are back; the ticks follow it.
    first_paint = after_restore(refresh, inputs, [*outputs, seen])
    compat.every(ctx.settings.refresh_seconds, refresh, inputs, [*outputs, seen], after=first_paint)
