"""Runs tab: every run in the runs folder with its state; attach one (also after a UI restart) and
download its LoRA."""
from __future__ import annotations

import datetime
from typing import Any

import gradio as gr
import pandas as pd

from ..compat import listen, make, update
from ..context import UIContext

TITLE = "Runs"
COLUMNS = ["run", "state", "step", "live", "updated", "LoRA files"]


def build(ctx: UIContext) -> None:
    p = ctx.parts
    p["runs.table"] = make(gr.Dataframe, label=f"Runs in {ctx.settings.runs_dir}", headers=COLUMNS,
                           interactive=False, wrap=True, elem_id="runs-table")
    with gr.Row():
        p["runs.choice"] = make(gr.Dropdown, label="Run", choices=ctx.run_labels(), value=None, scale=3,
                                elem_id="runs-choice")
        p["runs.refresh"] = make(gr.Button, value="Refresh", scale=1, elem_id="runs-refresh")
        p["runs.attach"] = make(gr.Button, value="Attach (Train, Monitor, Samples follow it)", variant="primary",
                                scale=2, elem_id="runs-attach")
    p["runs.message"] = make(gr.Markdown, value="")
    p["runs.files"] = make(gr.File, label="LoRA files of the chosen run (click to download)", file_count="multiple",
                           interactive=False, elem_id="runs-files")


def table(ctx: UIContext) -> pd.DataFrame:
    rows = []
    for run in ctx.hub.runs():
        reader = ctx.hub.reader(run.path)
        updated = datetime.datetime.fromtimestamp(run.updated_at).strftime("%Y-%m-%d %H:%M") if run.updated_at else ""
        step = f"{run.step}/{run.max_steps}" if run.max_steps else str(run.step)
        rows.append([ctx.run_label(run.path), run.state, step, "yes" if run.alive else "", updated,
                     ", ".join(p.name for p in reader.loras())])
    return pd.DataFrame(rows, columns=COLUMNS)


def _refresh(ctx: UIContext, label: str | None) -> list[Any]:
    labels = ctx.run_labels()
    label = label if label in labels else ctx.run_label(ctx.hub.attached)
    return [table(ctx), update(choices=labels, value=label), _choose(ctx, label)]


def _choose(ctx: UIContext, label: str | None) -> Any:
    reader = ctx.hub.reader(ctx.run_path(label)) if label else None
    files = [str(p) for p in reader.loras()] if reader else []
    return files or None


def _attach(ctx: UIContext, label: str | None) -> list[Any]:
    if not label:
        return ["Choose a run first.", update()]
    # This browser's Train dropdown is what its tabs follow; other browsers keep their own run.
    return [f"Attached **{label}**: the Train, Monitor, Samples and Diagnostics tabs of this page now show it.",
            update(choices=ctx.run_labels(ctx.run_path(label)), value=label)]


def wire(ctx: UIContext) -> None:
    p = ctx.parts
    listen(p["runs.refresh"].click, lambda label: _refresh(ctx, label), [p["runs.choice"]],
           [p["runs.table"], p["runs.choice"], p["runs.files"]])
    listen(p["runs.choice"].change, lambda label: _choose(ctx, label), [p["runs.choice"]], [p["runs.files"]])
    listen(p["runs.attach"].click, lambda label: _attach(ctx, label), [p["runs.choice"]],
           [p["runs.message"], p["train.run"]])


def live_outputs(ctx: UIContext) -> list[Any]:
    return [ctx.parts["runs.table"]]


def refresh(ctx: UIContext, seen: dict[str, Any]) -> list[Any]:
    frame = table(ctx)
    key = frame.to_json()
    if seen.get("runs") == key:
        return [update()]
    seen["runs"] = key
    return [frame]
