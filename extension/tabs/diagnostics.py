"""Diagnostics tab: LoRA singular-value spectra per module over time, effective rank, collapse warnings."""
from __future__ import annotations

from typing import Any

import gradio as gr

from .. import diagnostics
from ..compat import listen, make, update
from ..context import UIContext

TITLE = "Diagnostics"
EMPTY = ("No spectra yet. The engine writes `diagnostics/spectra.jsonl` (singular values of each LoRA module "
         "at each validation step) once the diagnostics work lands; this tab reads whatever the run has.")


def build(ctx: UIContext) -> None:
    p = ctx.parts
    p["diag.info"] = make(gr.Markdown, value=EMPTY, elem_id="diag-info")
    with gr.Row():
        p["diag.module"] = make(gr.Dropdown, label="Module", choices=[], value=None, scale=4)
        p["diag.refresh"] = make(gr.Button, value="Refresh", scale=1, elem_id="diag-refresh")
    with gr.Row():
        p["diag.heatmap"] = make(gr.Plot, label="Singular values over steps")
        p["diag.rank"] = make(gr.Plot, label="Effective rank")
    p["diag.warnings"] = make(gr.Dataframe, label="Collapse warnings", headers=["step", "kind", "message"],
                              interactive=False, wrap=True)


def _refresh(ctx: UIContext, module: str | None, label: str | None = None) -> list[Any]:
    run = ctx.run_path(label) or ctx.hub.attach_default()
    reader = ctx.hub.reader(run) if run else None
    if reader is None:
        return [EMPTY, update(choices=[], value=None), None, None, []]
    records = diagnostics.spectra(reader)
    names = diagnostics.modules(records)
    module = module if module in names else (names[0] if names else None)
    files = diagnostics.available(reader)
    info = (f"{len(records)} spectra of {len(names)} modules. Files: {', '.join(files)}" if records
            else EMPTY + (f" Files present: {', '.join(files)}." if files else ""))
    return [info, update(choices=names, value=module), diagnostics.heatmap(records, module),
            diagnostics.rank_lines(records), diagnostics.warnings(reader)]


def wire(ctx: UIContext) -> None:
    p = ctx.parts
    outputs = [p["diag.info"], p["diag.module"], p["diag.heatmap"], p["diag.rank"], p["diag.warnings"]]
    listen(p["diag.refresh"].click, lambda m, run: _refresh(ctx, m, run), [p["diag.module"], p["train.run"]], outputs)
    listen(p["diag.module"].change, lambda m, run: _refresh(ctx, m, run), [p["diag.module"], p["train.run"]], outputs)
