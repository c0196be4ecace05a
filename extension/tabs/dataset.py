"""Dataset tab: pick a folder, see its images with captions, edit a caption, counts, buckets, skipped files; the
caption editor's bulk changes and undo, auto-captioning and the dataset doctor (the last two in the engine's
process, with a progress line)."""

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
    _build_editor(p)
    _build_captioning(p)
    _build_doctor(p)
    p["dataset.items"] = gr.State([])
    p["dataset.index"] = gr.State(None)
    p["dataset.shown"] = gr.State([])  # indexes of the items the gallery shows (the search filters them)


def _build_editor(p: dict[str, Any]) -> None:
    with make(gr.Accordion, label="Edit captions in bulk", open=False, elem_id="dataset-editor"):
        p["dataset.search"] = make(gr.Textbox, label="Show only images whose caption contains",
                                   elem_id="dataset-search")
        with gr.Row():
            p["dataset.find"] = make(gr.Textbox, label="Find (text)", elem_id="dataset-find")
            p["dataset.replace_with"] = make(gr.Textbox, label="Replace with", elem_id="dataset-replace-with")
            p["dataset.replace"] = make(gr.Button, value="Replace in all captions", elem_id="dataset-replace")
        with gr.Row():
            p["dataset.tag"] = make(gr.Textbox, label="Tag", elem_id="dataset-tag")
            p["dataset.tag_first"] = make(gr.Button, value="Add to all (first)", elem_id="dataset-tag-first")
            p["dataset.tag_last"] = make(gr.Button, value="Add to all (last)", elem_id="dataset-tag-last")
            p["dataset.tag_remove"] = make(gr.Button, value="Remove from all", elem_id="dataset-tag-remove")
            p["dataset.undo"] = make(gr.Button, value="Undo last bulk change", elem_id="dataset-undo")
        p["dataset.bulk_status"] = make(gr.Markdown, value="Every write is atomic; the last bulk change can be undone.")
        p["dataset.frequency"] = make(gr.Dataframe, label="Tag frequency (images carrying each tag)",
                                      headers=["tag", "images"], interactive=False, wrap=True)


def _build_captioning(p: dict[str, Any]) -> None:
    with make(gr.Accordion, label="Auto-caption", open=False, elem_id="dataset-captioning"):
        gr.Markdown("A WD14 tagger folder (`model.onnx` + `selected_tags.csv`) writes booru tags; a BLIP or "
                    "Florence-2 folder (transformers) writes a sentence. Nothing is downloaded.")
        with gr.Row():
            p["dataset.cap_model"] = make(gr.Textbox, label="Captioning model folder", elem_id="dataset-cap-model",
                                          placeholder="/path/to/wd-vit-tagger-v3")
            p["dataset.cap_prefix"] = make(gr.Textbox, label="Trigger word(s) written first",
                                           elem_id="dataset-cap-prefix")
        with gr.Row():
            p["dataset.cap_threshold"] = make(gr.Slider, label="Tag threshold", minimum=0.05, maximum=1.0,
                                              step=0.01, value=0.35)
            p["dataset.cap_char_threshold"] = make(gr.Slider, label="Character tag threshold", minimum=0.05,
                                                   maximum=1.0, step=0.01, value=0.85)
            p["dataset.cap_underscores"] = make(gr.Checkbox, label="Keep underscores", value=False)
        with gr.Row():
            p["dataset.cap_exclude"] = make(gr.Textbox, label="Never write these tags (comma-separated)")
            p["dataset.cap_keep"] = make(gr.Textbox, label="Tags written first when found (comma-separated)")
            p["dataset.cap_existing"] = make(gr.Radio, label="Images that already have a caption",
                                             choices=["keep", "overwrite", "append"], value="keep",
                                             info="overwrite and append keep the old caption as NAME.txt.bak")
        p["dataset.cap_run"] = make(gr.Button, value="Caption images", variant="primary", elem_id="dataset-cap-run")
        p["dataset.cap_status"] = make(gr.Markdown, value="", elem_id="dataset-cap-status")


def _build_doctor(p: dict[str, Any]) -> None:
    with make(gr.Accordion, label="Dataset doctor", open=False, elem_id="dataset-doctor"):
        gr.Markdown("Duplicates, images much smaller than the resolution, the bucket and crop each image gets, "
                    "captions longer than the text encoder reads, folder balance; with a run folder, the images "
                    "the model could not fit.")
        with gr.Row():
            p["dataset.doctor_run"] = make(gr.Textbox, label="Run folder for the loss ranking (optional)",
                                           elem_id="dataset-doctor-run")
            p["dataset.doctor_go"] = make(gr.Button, value="Check dataset", variant="primary",
                                          elem_id="dataset-doctor-go")
        p["dataset.doctor_report"] = make(gr.Markdown, value="", elem_id="dataset-doctor-report")
        p["dataset.doctor_previews"] = make(gr.Gallery, label="What the model sees (centred crop in its bucket), "
                                            "most cropped first", columns=6, height=300, allow_preview=True,
                                            object_fit="contain", elem_id="dataset-doctor-previews")
        p["dataset.doctor_items"] = make(gr.Dataframe, label="Per image", interactive=False, wrap=True,
                                         headers=["file", "size", "bucket", "kept", "tokens", "caption"])
        p["dataset.doctor_losses"] = make(gr.Dataframe, label="Per-image loss ranking (1.0 = typical)",
                                          interactive=False, wrap=True,
                                          headers=["file", "loss vs typical", "samples", ""])


def _scan(ctx: UIContext, folder: str, *options: Any) -> list[Any]:
    result = dataset_view.scan(folder, ctx.settings.engine_python, dict(zip(SCAN_OPTIONS, options)))
    if "error" in result:
        empty = pd.DataFrame()
        return [f"⚠ {result['error']}", [], empty, empty, [], None, [], empty]
    buckets = pd.DataFrame(result["buckets"], columns=["bucket", "images"])
    skipped = pd.DataFrame([[s["path"], s["reason"]] for s in result["skipped"]], columns=["file", "reason"])
    items = result["items"]
    frequency = pd.DataFrame(dataset_view.frequency_rows(items, options[0]), columns=["tag", "images"])
    return [dataset_view.counts_text(result), dataset_view.gallery_items(items), buckets, skipped, items, None,
            list(range(len(items))), frequency]


def _select(items: list[dict[str, Any]], shown: list[int], evt: gr.SelectData) -> list[Any]:
    index = evt.index if isinstance(evt.index, int) else evt.index[0]
    index = shown[index] if shown and index < len(shown) else index
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


def _search(items: list[dict[str, Any]], query: str) -> list[Any]:
    shown = dataset_view.filter_items(items, query)
    return [dataset_view.gallery_items([items[i] for i in shown]), shown]


def _bulk(action: str):
    def change(folder: str, items: list[dict[str, Any]], extension: str, query: str, first: str = "",
               second: str = "") -> list[Any]:
        message = dataset_view.bulk_change(folder, items, extension, action, first, second)
        items = dataset_view.refreshed(items, extension)
        gallery, shown = _search(items, query)
        frequency = pd.DataFrame(dataset_view.frequency_rows(items, extension), columns=["tag", "images"])
        return [message, gallery, items, shown, frequency]

    return change


def _caption(ctx: UIContext, folder: str, items: list[dict[str, Any]], extension: str, query: str, model: str,
             prefix: str, threshold: float, char_threshold: float, underscores: bool, exclude: str, keep: str,
             existing: str):
    """A generator: the progress line while the engine captions, then the summary and the new captions."""
    if not (folder or "").strip() or not (model or "").strip():
        yield ["⚠ Choose the dataset folder and the captioning model folder.", update(), items, update()]
        return
    argv = dataset_view.tool_command(ctx.settings.engine_python, "caption", *dataset_view.caption_args(
        folder, model, prefix=prefix, threshold=threshold, character_threshold=char_threshold, exclude=exclude,
        keep=keep, existing=existing, keep_underscores=underscores, caption_extension=extension))
    yield ["Starting the captioner...", update(), items, update()]
    for line, result in dataset_view.run_tool(argv):
        if result is None:
            yield [f"`{line}`", update(), items, update()]
            continue
        items = dataset_view.refreshed(items, extension)
        gallery, shown = _search(items, query)
        yield [result.replace("\n", "  \n"), gallery, items, shown]


def _doctor(ctx: UIContext, folder: str, run: str, *options: Any):
    yield ["Checking the dataset (decoding every image)...", update(), update(), update()]
    report = dataset_view.doctor(folder, ctx.settings.engine_python, dict(zip(SCAN_OPTIONS, options[:-1]),
                                 pretrained_model_name_or_path=options[-1]), run_dir=(run or "").strip())
    rows, losses = dataset_view.doctor_tables(report)
    yield [dataset_view.doctor_text(report), dataset_view.doctor_previews(report),
           pd.DataFrame(rows, columns=["file", "size", "bucket", "kept", "tokens", "caption"]),
           pd.DataFrame(losses, columns=["file", "loss vs typical", "samples", ""])]


def wire(ctx: UIContext) -> None:
    p, fields = ctx.parts, ctx.form.components
    listen(p["dataset.scan"].click, lambda *a: _scan(ctx, *a),
           [fields["train_data_dir"], *(fields[n] for n in SCAN_OPTIONS)],
           [p["dataset.counts"], p["dataset.gallery"], p["dataset.buckets"], p["dataset.skipped"],
            p["dataset.items"], p["dataset.index"], p["dataset.shown"], p["dataset.frequency"]])
    listen(p["dataset.gallery"].select, _select, [p["dataset.items"], p["dataset.shown"]],
           [p["dataset.index"], p["dataset.selected"], p["dataset.caption"], p["dataset.saved"]])
    listen(p["dataset.search"].change, _search, [p["dataset.items"], p["dataset.search"]],
           [p["dataset.gallery"], p["dataset.shown"]])
    common = [fields["train_data_dir"], p["dataset.items"], fields["caption_extension"], p["dataset.search"]]
    bulk_out = [p["dataset.bulk_status"], p["dataset.gallery"], p["dataset.items"], p["dataset.shown"],
                p["dataset.frequency"]]
    listen(p["dataset.replace"].click, _bulk("replace"), [*common, p["dataset.find"], p["dataset.replace_with"]],
           bulk_out)
    for button, action in (("tag_first", "add first"), ("tag_last", "add last"), ("tag_remove", "remove")):
        listen(p[f"dataset.{button}"].click, _bulk(action), [*common, p["dataset.tag"]], bulk_out)
    listen(p["dataset.undo"].click, _bulk("undo"), common, bulk_out)
    listen(p["dataset.cap_run"].click, lambda *a: (yield from _caption(ctx, *a)),
           [*common, p["dataset.cap_model"], p["dataset.cap_prefix"], p["dataset.cap_threshold"],
            p["dataset.cap_char_threshold"], p["dataset.cap_underscores"], p["dataset.cap_exclude"],
            p["dataset.cap_keep"], p["dataset.cap_existing"]],
           [p["dataset.cap_status"], p["dataset.gallery"], p["dataset.items"], p["dataset.shown"]])
    listen(p["dataset.doctor_go"].click, lambda *a: (yield from _doctor(ctx, *a)),
           [fields["train_data_dir"], p["dataset.doctor_run"], *(fields[n] for n in SCAN_OPTIONS),
            fields["pretrained_model_name_or_path"]],
           [p["dataset.doctor_report"], p["dataset.doctor_previews"], p["dataset.doctor_items"],
            p["dataset.doctor_losses"]])
    listen(p["dataset.save"].click, _save,
           [p["dataset.items"], p["dataset.index"], p["dataset.caption"], fields["caption_extension"]],
           [p["dataset.saved"], p["dataset.gallery"], p["dataset.items"]])
