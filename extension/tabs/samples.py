"""Samples tab: validation images per step; the same prompt and seed line up across steps."""
from __future__ import annotations

from typing import Any

import gradio as gr

from .. import samples
from ..compat import file_url, listen, make, unchanged, update, user_change
from ..context import UIContext

TITLE = "Samples"


def build(ctx: UIContext) -> None:
    p = ctx.parts
    p["samples.view"] = make(gr.Dropdown, label="Show", choices=[samples.ALL], value=samples.ALL,
                             elem_id="samples-view")
    gr.Markdown("Each row is one validation step, newest first; each column keeps its prompt and seed, so you see "
                "the same picture change as the LoRA learns. Pick one prompt/seed above to see it across all steps "
                "in a row. Click an image to open it whole.")
    p["samples.gallery"] = make(gr.HTML, value=samples.grid_html_empty(), elem_id="samples-gallery")


def _show(ctx: UIContext, view: str, label: str | None = None) -> Any:
    run = ctx.followed(label)
    reader = ctx.hub.reader(run) if run else None
    if reader is None:
        return update(value=samples.grid_html_empty())
    return update(value=samples.grid_html(reader, view, file_url))


def wire(ctx: UIContext) -> None:
    p = ctx.parts
    listen(user_change(p["samples.view"]), lambda view, label: _show(ctx, view, label),
           [p["samples.view"], p["train.run"]], [p["samples.gallery"]])


def live_inputs(ctx: UIContext) -> list[Any]:
    return [ctx.parts["samples.view"]]


def live_outputs(ctx: UIContext) -> list[Any]:
    return [ctx.parts["samples.view"], ctx.parts["samples.gallery"]]


def refresh(ctx: UIContext, seen: dict[str, Any], view: str) -> list[Any]:
    run = ctx.run_of(seen)
    reader = ctx.hub.reader(run) if run else None
    key = (str(run), samples.signature(reader) if reader else ())
    if seen.get("samples") == key:  # only a new step's images are worth re-sending the gallery
        return [unchanged(), unchanged()]
    seen["samples"] = key
    if reader is None:
        return [update(choices=[samples.ALL], value=samples.ALL), update(value=samples.grid_html_empty())]
    choices = samples.choices(reader)
    view = view if view in choices else samples.ALL
    return [update(choices=choices, value=view), _show(ctx, view, str(run))]
