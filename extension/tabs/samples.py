"""Samples tab: validation images per step (the same prompt and seed line up across steps), their perceptual drift
charts (a judge for any run: each kept prompt's drift from the base's own images and the concept prompts' distance to
the training images, read from RUN/diagnostics/perceptual_drift.jsonl), and the checkpoint comparison grid: chosen
checkpoints x LoRA strengths x seeds beside the base model's image."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import gradio as gr

import pandas as pd

from stabletune_core.runs.jsonfiles import read_jsonl
from stabletune_core.runs.layout import RunPaths

from .. import grids, plots, samples
from ..compat import file_url, listen, make, unchanged, update, user_change
from ..context import UIContext

TITLE = "Samples"
GRID_OUTPUTS = ("samples.checkpoints", "samples.seeds", "samples.grid_progress", "samples.grid_choice",
                "samples.grid")
DRIFT_OUTPUTS = ("samples.drift_note", "samples.drift_kept", "samples.drift_concept")
#: chart -> (title, y axis title): the drift of each kept prompt, the distance of each concept prompt
DRIFT_PLOTS = {"samples.drift_kept": ("Kept prompts: drift from the base's own image (same prompt and seed)",
                                      "drift (0 = the base's image)"),
               "samples.drift_concept": ("Concept prompts: distance to the nearest training image",
                                         "distance (lower = closer)")}
MEASURES = {"vae_latent": "distances in the model's own VAE latent space (LPIPS's backbone weights are not on this "
                          "machine)", "lpips_alex": "LPIPS (AlexNet)"}


def _empty_long() -> pd.DataFrame:
    return pd.DataFrame({"step": pd.Series(dtype=float), "value": pd.Series(dtype=float),
                         "series": pd.Series(dtype=str)})


def drift_frames(run: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(kept prompts' drift, concept prompts' distance to the training images) over the samplings, each long
    (step, value, series = the prompt), from the run folder's perceptual_drift.jsonl (the UI never imports torch)."""
    records = read_jsonl(RunPaths(run).perceptual_drift)[0]
    kept = [{"step": r["step"], "value": v["mean"], "series": prompt} for r in records
            for prompt, v in r.get("drift", {}).items() if prompt in r.get("kept", [])]
    concept = [{"step": r["step"], "value": v["mean"], "series": prompt} for r in records
               for prompt, v in r.get("nearest", {}).items()]
    return tuple(pd.DataFrame.from_records(rows) if rows else _empty_long() for rows in (kept, concept))


def drift_note(run: Path) -> str:
    """One line over the charts: what measures them, and how many images the last sampling read."""
    records = read_jsonl(RunPaths(run).perceptual_drift)[0]
    if not records:
        return ("Perceptual drift: the charts fill in once the run has made validation images (its step-0 images "
                "are the base's own, what the drift is measured against).")
    last = records[-1]
    line = (f"Perceptual drift, in {MEASURES.get(last['measure'], last['measure'])}: step {last['step']}, "
            f"{last['images']} images read")
    if last.get("unpaired"):
        line += f", {last['unpaired']} without their step-0 image (not measured)"
    if not last.get("concept"):
        line += ("; no concept prompt (no validation prompt names a word the training captions are about: "
                 f"{', '.join(last.get('concept_words') or []) or 'none found'})")
    return line + "."


def build(ctx: UIContext) -> None:
    p = ctx.parts
    p["samples.view"] = make(gr.Dropdown, label="Show", choices=[samples.ALL], value=samples.ALL,
                             elem_id="samples-view")
    gr.Markdown("Each row is one validation step, newest first; each column keeps its prompt and seed, so you see "
                "the same picture change as the LoRA learns. Pick one prompt/seed above to see it across all steps "
                "in a row. Click an image to open it whole.")
    p["samples.gallery"] = make(gr.HTML, value=samples.grid_html_empty(), elem_id="samples-gallery")
    p["samples.drift_note"] = make(gr.Markdown, value="", elem_id="samples-drift-note")
    with gr.Row():
        for key, (title, y_title) in DRIFT_PLOTS.items():
            with make(gr.Column, min_width=320):
                p[key] = make(gr.LinePlot, value=None, x="step", y="value", color="series", title=title,
                              x_title="step", y_title=y_title, label=title, show_label=False, color_title="",
                              height=300, tooltip=["step", "value", "series"],
                              elem_id=key.replace(".", "-").replace("_", "-"))
    with make(gr.Accordion, label="Compare checkpoints: which step, at which LoRA strength?", open=True,
              elem_id="samples-grid-box"):
        gr.Markdown("Renders each chosen checkpoint at each LoRA strength with fixed seeds for the validation "
                    "prompts, with the base model's image (no LoRA) beside each row, into `RUN/grids/`. It runs in "
                    "its own process and only reads the run: a training that runs now is not disturbed.")
        with gr.Row():
            p["samples.checkpoints"] = make(gr.Dropdown, label="Checkpoints", choices=[], value=[], multiselect=True,
                                            scale=3, elem_id="samples-checkpoints")
            p["samples.strengths"] = make(gr.Textbox, label="LoRA strengths", value=grids.DEFAULT_STRENGTHS, scale=2,
                                          elem_id="samples-strengths")
            p["samples.seeds"] = make(gr.Textbox, label="Seeds (empty: the run's validation seeds)", value="",
                                      scale=2, elem_id="samples-seeds")
            p["samples.render"] = make(gr.Button, value="Render grid", variant="primary", scale=1,
                                       elem_id="samples-render")
            p["samples.cancel_grid"] = make(gr.Button, value="Cancel grid", variant="stop", scale=1,
                                            elem_id="samples-cancel-grid")
        p["samples.grid_message"] = make(gr.Markdown, value="", elem_id="samples-grid-message")
        p["samples.grid_progress"] = make(gr.Markdown, value="", elem_id="samples-grid-progress")
        p["samples.grid_choice"] = make(gr.Dropdown, label="Grid", choices=[], value=None, elem_id="samples-grid-choice",
                                        allow_custom_value=True)
        p["samples.grid"] = make(gr.Image, label="Checkpoint grid", value=None, type="filepath", interactive=False,
                                 elem_id="samples-grid")


def _show(ctx: UIContext, view: str, label: str | None = None) -> Any:
    run = ctx.followed(label)
    reader = ctx.hub.reader(run) if run else None
    if reader is None:
        return update(value=samples.grid_html_empty())
    return update(value=samples.grid_html(reader, view, file_url))


def _render(ctx: UIContext, label: str | None, checkpoints: list[str] | None, strengths: str, seeds: str) -> str:
    run = ctx.followed(label)
    if run is None:
        return "⚠ Attach a run first (Train tab or Runs)."
    return grids.start(ctx.settings.engine_python, run, list(checkpoints or []), strengths, seeds)


def _cancel(ctx: UIContext, label: str | None) -> str:
    run = ctx.followed(label)
    return grids.cancel(run) if run is not None else "⚠ Attach a run first (Train tab or Runs)."


def _choose_grid(ctx: UIContext, label: str | None, name: str | None) -> Any:
    run = ctx.followed(label)
    found = {g["name"]: g["png"] for g in grids.grids(run)} if run else {}
    return found.get(name) if name else None


def wire(ctx: UIContext) -> None:
    p = ctx.parts
    listen(user_change(p["samples.view"]), lambda view, label: _show(ctx, view, label),
           [p["samples.view"], p["train.run"]], [p["samples.gallery"]])
    listen(p["samples.render"].click, lambda *args: _render(ctx, *args),
           [p["train.run"], p["samples.checkpoints"], p["samples.strengths"], p["samples.seeds"]],
           [p["samples.grid_message"]])
    listen(p["samples.cancel_grid"].click, lambda label: _cancel(ctx, label), [p["train.run"]],
           [p["samples.grid_message"]])
    listen(user_change(p["samples.grid_choice"]), lambda label, name: _choose_grid(ctx, label, name),
           [p["train.run"], p["samples.grid_choice"]], [p["samples.grid"]])


def live_inputs(ctx: UIContext) -> list[Any]:
    return [ctx.parts["samples.view"], ctx.parts["samples.grid_choice"]]


def live_outputs(ctx: UIContext) -> list[Any]:
    return [ctx.parts["samples.view"], ctx.parts["samples.gallery"], *(ctx.parts[k] for k in GRID_OUTPUTS),
            *(ctx.parts[k] for k in DRIFT_OUTPUTS)]


def refresh(ctx: UIContext, seen: dict[str, Any], view: str, grid_choice: str | None = None) -> list[Any]:
    run = ctx.run_of(seen)
    reader = ctx.hub.reader(run) if run else None
    return [*_refresh_samples(ctx, seen, run, reader, view), *_refresh_grids(seen, run, reader, grid_choice),
            *_refresh_drift(seen, run)]


def _refresh_drift(seen: dict[str, Any], run: Path | None) -> list[Any]:
    """The drift charts, re-sent only when a sampling's record lands (or the run followed changes)."""
    path = RunPaths(run).perceptual_drift if run else None
    key = (str(run), path.stat().st_size if path is not None and path.is_file() else 0)
    if seen.get("samples.drift") == key:
        return [unchanged()] * len(DRIFT_OUTPUTS)
    if run is None:
        seen["samples.drift"] = key
        return ["", None, None]
    drawn = seen.setdefault("samples.drift_series", {})
    values, cleared = [], False
    for name, long in zip(DRIFT_PLOTS, drift_frames(run)):
        value, drawn[name] = plots.plot_update(long, drawn.get(name))
        values.append(value)
        cleared |= value is None and not long.empty  # cleared for a new series set: data on the next tick
    if not cleared:
        seen["samples.drift"] = key
    return [drift_note(run), *values]


def _refresh_samples(ctx: UIContext, seen: dict[str, Any], run: Path | None, reader: Any, view: str) -> list[Any]:
    key = (str(run), samples.signature(reader) if reader else ())
    if seen.get("samples") == key:  # only a new step's images are worth re-sending the gallery
        return [unchanged(), unchanged()]
    seen["samples"] = key
    if reader is None:
        return [update(choices=[samples.ALL], value=samples.ALL), update(value=samples.grid_html_empty())]
    choices = samples.choices(reader)
    view = view if view in choices else samples.ALL
    return [update(choices=choices, value=view), _show(ctx, view, str(run))]


def _refresh_grids(seen: dict[str, Any], run: Path | None, reader: Any, choice: str | None) -> list[Any]:
    """Checkpoints to choose from, the run's seeds, grids rendering, and the newest finished grid once it lands."""
    checkpoints = grids.checkpoint_choices(reader) if reader else []
    made = grids.grids(run) if run else []
    finished = [g["name"] for g in made if g["png"]]
    key = (str(run), checkpoints, [(g["name"], g["state"], g["done"], g["doing"]) for g in made])
    if seen.get("grids") == key:
        return [unchanged()] * len(GRID_OUTPUTS)
    new_run = seen.get("grids", (None,))[0] != str(run)
    before = set(seen.get("grids.finished", []))
    seen["grids"], seen["grids.finished"] = key, finished
    if checkpoints and seen.get("grids.picked") != str(run):  # the newest checkpoint, once per run, as a start
        seen["grids.picked"] = str(run)
        picks = update(choices=checkpoints, value=checkpoints[-1:])
    else:
        picks = update(choices=checkpoints, value=[]) if new_run else update(choices=checkpoints)
    seeds = update(value=grids.run_seeds(run)) if new_run and run else unchanged()
    landed = [name for name in finished if name not in before]
    if landed or new_run or (choice and choice not in finished):
        shown = landed[0] if landed else (finished[0] if finished else None)
        png = next((g["png"] for g in made if g["name"] == shown), None)
        chooser, image = update(choices=finished, value=shown), update(value=png)
    else:
        chooser, image = update(choices=finished), unchanged()
    return [picks, seeds, grids.progress_text(run) if run else "", chooser, image]
