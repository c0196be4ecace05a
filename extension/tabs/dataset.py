"""Dataset tab: pick a folder, see its images with captions, edit a caption, counts, buckets, skipped files."""

from typing import Any

import gradio as gr
import pandas as pd

from .. import dataset_view
from ..compat import listen, make, update
from ..context import UIContext

TITLE = "Dataset"
# Form fields the scan depends on (they live in the Model tab's Data section, except the folder).
SCAN_OPTIONS = ("caption_extension", "default_caption", "resolution", "bucket_step", "min_bucket_reso",
                "max_bucket_reso", "enable_bucket")


def build(ctx: UIContext) -> None:
    p = ctx.parts
    gr.Markdown("Images with a same-name `.txt` caption. Subfolders named `N_name` repeat their images N "
                "times (kohya style). The scan decodes every image, so broken files are listed before training.")
    with gr.Row():
        with make(gr.Column, scale=4):
            ctx.form.build(["train_data_dir"], placeholder="/path/to/images")
        with make(gr.Column, scale=1, min_width=120):
            p["dataset.scan"] = make(gr.Button, value="Scan folder", variant="primary", elem_id="dataset-scan")
    p["dataset.counts"] = make(gr.Markdown, value="Choose a folder and click **Scan folder**.",
                               elem_id="dataset-counts")
    with gr.Row():
        with make(gr.Column, scale=3):
            p["dataset.gallery"] = make(gr.Gallery, label="Images and captions (click one to edit its caption)",
                                        columns=6, height=420, allow_preview=False, object_fit="contain",
                                        elem_id="dataset-gallery")
        with make(gr.Column, scale=2):
            p["dataset.selected"] = make(gr.Markdown, value="No image selected.")
            p["dataset.caption"] = make(gr.Textbox, label="Caption", lines=4, elem_id="dataset-caption")
            p["dataset.save"] = make(gr.Button, value="Save caption", elem_id="dataset-save-caption")
            p["dataset.saved"] = make(gr.Markdown, value="")
    with gr.Row():
        p["dataset.buckets"] = make(gr.Dataframe, label="Bucket distribution (images per epoch)",
                                    headers=["bucket", "images"], interactive=False, wrap=True)
        p["dataset.skipped"] = make(gr.Dataframe, label="Skipped files and why", headers=["file", "reason"],
                                    interactive=False, wrap=True)
    p["dataset.items"] = gr.State([])
    p["dataset.index"] = gr.State(None)


def _scan(ctx: UIContext, folder: str, *options: Any) -> list[Any]:
    result = dataset_view.scan(folder, ctx.settings.engine_python, dict(zip(SCAN_OPTIONS, options)))
    if "error" in result:
        empty = pd.DataFrame()
        return [f"⚠ {result['error']}", [], empty, empty, [], None]
    buckets = pd.DataFrame(result["buckets"], columns=["bucket", "images"])
    skipped = pd.DataFrame([[s["path"], s["reason"]] for s in result["skipped"]], columns=["file", "reason"])
    return [dataset_view.counts_text(result), dataset_view.gallery_items(result["items"]), buckets, skipped,
            result["items"], None]


def _select(items: list[dict[str, Any]], evt: gr.SelectData) -> list[Any]:
    index = evt.index if isinstance(evt.index, int) else evt.index[0]
    item = items[index]
    return [index, f"**{item['path']}** · {item['width']}×{item['height']} · bucket "
                   f"{item['bucket'][0]}×{item['bucket'][1]} · repeats {item['repeats']}", item["caption"], ""]


def _save(items: list[dict[str, Any]], index: int | None, caption: str, extension: str) -> list[Any]:
    if index is None or index >= len(items):
        return ["Click an image first.", update(), items]
    try:
        path = dataset_view.save_caption(items[index]["path"], caption, extension or ".txt")
    except OSError as exc:
        return [f"⚠ Could not write the caption: {exc}", update(), items]
    items = [dict(item, caption=caption.strip()) if i == index else item for i, item in enumerate(items)]
    return [f"Saved {path.name}.", dataset_view.gallery_items(items), items]


def wire(ctx: UIContext) -> None:
    p, fields = ctx.parts, ctx.form.components
    listen(p["dataset.scan"].click, lambda *a: _scan(ctx, *a),
           [fields["train_data_dir"], *(fields[n] for n in SCAN_OPTIONS)],
           [p["dataset.counts"], p["dataset.gallery"], p["dataset.buckets"], p["dataset.skipped"],
            p["dataset.items"], p["dataset.index"]])
    listen(p["dataset.gallery"].select, _select, [p["dataset.items"]],
           [p["dataset.index"], p["dataset.selected"], p["dataset.caption"], p["dataset.saved"]])
    listen(p["dataset.save"].click, _save,
           [p["dataset.items"], p["dataset.index"], p["dataset.caption"], fields["caption_extension"]],
           [p["dataset.saved"], p["dataset.gallery"], p["dataset.items"]])
