"""Diagnostics tab, refreshed live: LoRA singular-value spectra per module, effective rank of every module,
activation statistics, the validation loss with early stopping's marks, collapse warnings, and the offer to
resize a LoRA that uses fewer ranks than it has."""
from __future__ import annotations

from typing import Any

import gradio as gr

from .. import diagnostics, resize_offer
from ..compat import listen, make, unchanged, update, user_change
from ..context import UIContext

TITLE = "Diagnostics"
EMPTY = ("Nothing recorded yet: the run writes spectra, activation statistics and the validation loss under "
         "`diagnostics/` at its validation and diagnostics steps (see the Diagnostics and Validation settings).")
OUTPUTS = ("diag.info", "diag.module", "diag.heatmap", "diag.rank", "diag.activations", "diag.val", "diag.warnings",
           "diag.suggest", "diag.resize_rank")


def build(ctx: UIContext) -> None:
    p = ctx.parts
    p["diag.info"] = make(gr.Markdown, value=EMPTY, elem_id="diag-info")
    with gr.Row():
        # Plots carry their own titles; a Gradio label would sit on top of them (show_label=False).
        p["diag.val"] = make(gr.Plot, label="Validation loss (best and early-stopping triggers marked)",
                             show_label=False, elem_id="diag-val")
    with gr.Row():
        p["diag.module"] = make(gr.Dropdown, label="Module (singular values)", choices=[], value=None, scale=4)
        p["diag.stat"] = make(gr.Radio, label="Activation statistic", choices=list(diagnostics.ACTIVATION_STATS),
                              value="var", scale=2)
    with gr.Row():
        p["diag.heatmap"] = make(gr.Plot, label="Singular values over steps", show_label=False,
                                 elem_id="diag-heatmap")
        p["diag.rank"] = make(gr.Plot, label="Effective rank (module x step)", show_label=False, elem_id="diag-rank")
    p["diag.activations"] = make(gr.Plot, label="Activation statistics (module x step)", show_label=False,
                                 elem_id="diag-activations")
    p["diag.warnings"] = make(gr.Dataframe, label="Collapse warnings", headers=["step", "kind", "message"],
                              interactive=False, wrap=True)
    p["diag.suggest"] = make(gr.Markdown, value="", elem_id="diag-suggest")
    with gr.Row():
        p["diag.resize_rank"] = make(gr.Number, label="New rank", value=None, precision=0, scale=1,
                                     elem_id="diag-resize-rank")
        p["diag.resize"] = make(gr.Button, value="Resize the LoRA (writes a new file beside it)", scale=2,
                                elem_id="diag-resize")
    p["diag.resize_message"] = make(gr.Markdown, value="", elem_id="diag-resize-message")


def offer(ctx: UIContext, run: Any, records: list[dict[str, Any]]) -> list[Any]:
    """The resize offer's sentence and the rank it proposes (the rank field is left alone without one)."""
    found = resize_offer.suggest(records)
    if found is None:
        return ["", unchanged()]
    rank, sentence = found
    step = max(r["step"] for r in records)
    lora = resize_offer.run_lora(run)
    where = (f"Resize writes `{lora.stem}-r{rank}.safetensors` beside `{lora.name}`; the original stays."
             if lora else "The LoRA is exported when the run finishes or is stopped; resize it then.")
    return [f"**Resize offer** (spectra at step {step}): {sentence}. {where}", update(value=rank)]


def figures(ctx: UIContext, run: Any, module: str | None, stat: str | None) -> list[Any]:
    reader = ctx.hub.reader(run) if run else None
    if reader is None:
        return [EMPTY, update(choices=[], value=None), None, None, None, None, [], "", unchanged()]
    records = diagnostics.spectra(reader)
    names = diagnostics.modules(records)
    module = module if module in names else (names[0] if names else None)
    files = diagnostics.available(reader)
    info = (f"{len(records)} spectra of {len(names)} modules. Files: {', '.join(files)}" if files else EMPTY)
    return [info, update(choices=names, value=module), diagnostics.heatmap(records, module),
            diagnostics.rank_heatmap(records), diagnostics.activation_heatmap(diagnostics.activations(reader), stat or "var"),
            diagnostics.val_loss_figure(reader), diagnostics.warnings(reader), *offer(ctx, run, records)]


def _resize(ctx: UIContext, label: str | None, rank: Any) -> str:
    run = ctx.followed(label)
    return resize_offer.resize(ctx.settings.engine_python, resize_offer.run_lora(run), rank)


def wire(ctx: UIContext) -> None:
    p = ctx.parts
    outputs = [p[k] for k in OUTPUTS]
    for control in ("diag.module", "diag.stat"):
        listen(user_change(p[control]),
               lambda m, s, run: [*figures(ctx, ctx.followed(run), m, s)[:-1],
                                  unchanged()],  # a rank the user typed stays while they browse modules
               [p["diag.module"], p["diag.stat"], p["train.run"]], outputs)
    listen(p["diag.resize"].click, lambda label, rank: _resize(ctx, label, rank), [p["train.run"], p["diag.resize_rank"]],
           [p["diag.resize_message"]])


def live_inputs(ctx: UIContext) -> list[Any]:
    return [ctx.parts["diag.module"], ctx.parts["diag.stat"]]


def live_outputs(ctx: UIContext) -> list[Any]:
    return [ctx.parts[k] for k in OUTPUTS]


def refresh(ctx: UIContext, seen: dict[str, Any], module: str | None, stat: str | None) -> list[Any]:
    """Redrawn only when a diagnostics file or the events grew (figures are costly to send)."""
    run = ctx.run_of(seen)
    folder = ctx.hub.reader(run).paths.diagnostics if run else None
    sizes = tuple(sorted((f.name, f.stat().st_size) for f in folder.glob("*.jsonl"))) if folder and folder.is_dir() else ()
    key = (str(run), sizes, len(ctx.hub.reader(run).events()) if run else 0)
    if seen.get("diagnostics") == key:
        return [unchanged()] * len(OUTPUTS)
    seen["diagnostics"] = key
    return figures(ctx, run, module, stat)
