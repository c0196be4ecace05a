"""Runs tab: every run in the runs folder with its state; attach one (also after a UI restart), download
its LoRA or newest checkpoint, load its settings into the form, delete it (confirmed; only the run folder)."""
from __future__ import annotations

import datetime
import shlex
import shutil
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

from ..compat import listen, make, unchanged, update
from ..context import UIContext
from stabletune_core.runs.layout import RunPaths
from stabletune_core.runs.reader import RunReader

try:  # Python 3.11+; A1111 hosts may run 3.10 with tomli
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - depends on the host
    import tomli as tomllib  # type: ignore[no-redef]

TITLE = "Runs"
COLUMNS = ["run", "state", "step", "live", "updated", "LoRA files"]


def build(ctx: UIContext) -> None:
    p = ctx.parts
    p["runs.table"] = make(gr.Dataframe, label=f"Runs in {ctx.settings.runs_dir}", headers=COLUMNS,
                           interactive=False, wrap=True, elem_id="runs-table")
    with gr.Row():
        p["runs.choice"] = make(gr.Dropdown, label="Run", choices=ctx.run_labels(), value=None, scale=3,
                                elem_id="runs-choice", allow_custom_value=True)  # checked here (see train.run)
        p["runs.refresh"] = make(gr.Button, value="Refresh", scale=1, elem_id="runs-refresh")
        p["runs.attach"] = make(gr.Button, value="Attach (Train, Monitor, Samples follow it)", variant="primary",
                                scale=2, elem_id="runs-attach")
    with gr.Row():
        p["runs.load"] = make(gr.Button, value="Load its settings into the form", elem_id="runs-load")
        p["runs.zip"] = make(gr.Button, value="Zip its newest checkpoint for download", elem_id="runs-zip")
        p["runs.confirm"] = make(gr.Checkbox, value=False, label="Yes, delete this run's folder (checkpoints, "
                                 "samples, LoRAs). Datasets and models are never touched.", elem_id="runs-confirm")
        p["runs.delete"] = make(gr.Button, value="Delete run", variant="stop", elem_id="runs-delete")
    p["runs.message"] = make(gr.Markdown, value="", elem_id="runs-message")
    p["runs.files"] = make(gr.File, label="Files of the chosen run (click to download)", file_count="multiple",
                           interactive=False, elem_id="runs-files")
    p["runs.tensorboard"] = make(gr.Markdown, value="", elem_id="runs-tensorboard")


def table(ctx: UIContext) -> pd.DataFrame:
    rows = []
    for run in ctx.hub.runs():
        reader = ctx.hub.reader(run.path)
        updated = datetime.datetime.fromtimestamp(run.updated_at).strftime("%Y-%m-%d %H:%M") if run.updated_at else ""
        step = f"{run.step}/{run.max_steps}" if run.max_steps else str(run.step)
        rows.append([ctx.run_label(run.path), run.state, step, "yes" if run.alive else "no", updated,
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


def tensorboard_hint(run: Path | None) -> str:
    """How to open the run's TensorBoard logs (report_to=tensorboard writes them under RUN/tensorboard)."""
    if run is None:
        return ""
    folder = RunPaths(run).tensorboard
    if folder.is_dir():
        return (f"**TensorBoard logs** of this run: `tensorboard --logdir {shlex.quote(str(folder))}`, then open "
                "http://localhost:6006 (loss, learning rate, grad norm, memory, validation loss, samples).")
    try:
        with open(RunPaths(run).config, "rb") as f:
            asked = tomllib.load(f).get("report_to") in ("tensorboard", "all")
    except (OSError, ValueError):
        asked = False
    if asked:
        return ("This run asked for TensorBoard logs (report_to=tensorboard) but has written none yet; if it has "
                "trained a step, its train.log says why (usually: the tensorboard package is missing).")
    return ""


def _attach(ctx: UIContext, label: str | None) -> list[Any]:
    if not label:
        return ["Choose a run first.", update()]
    # This browser's Train dropdown is what its tabs follow; other browsers keep their own run.
    return [f"Attached **{label}**: the Train, Monitor, Samples and Diagnostics tabs of this page now show it.",
            update(choices=ctx.run_labels(ctx.run_path(label)), value=label)]


def delete_problem(ctx: UIContext, run: Path | None, confirmed: bool) -> str | None:
    """Why `run` may not be deleted, or None. Only a run folder directly in the runs folder, not live,
    and holding neither the dataset nor the model it trained on."""
    if run is None:
        return "Choose a run first."
    if not confirmed:
        return "Tick the box to confirm: the run's checkpoints, samples and LoRAs are deleted for good."
    paths = RunPaths(run)
    if run.resolve().parent != ctx.settings.runs_dir or not (paths.config.exists() or paths.status.exists()):
        return f"{run} is not a run folder in {ctx.settings.runs_dir}; only runs there can be deleted here."
    if ctx.hub.is_live(run):
        return f"{ctx.run_label(run)} is still running; stop it first."
    try:
        with open(paths.config, "rb") as f:
            config = tomllib.load(f)
    except (OSError, ValueError):
        config = {}
    for key in ("train_data_dir", "pretrained_model_name_or_path"):
        source = str(config.get(key) or "")
        if source and Path(source).expanduser().resolve().is_relative_to(run.resolve()):
            return f"{ctx.run_label(run)} holds its own {key} ({source}); move that out first."
    return None


def _delete(ctx: UIContext, label: str | None, confirmed: bool) -> list[Any]:
    run = ctx.run_path(label)
    problem = delete_problem(ctx, run, confirmed)
    if problem:
        return [f"⚠ {problem}", unchanged(), unchanged(), update(value=False)]
    shutil.rmtree(run)
    ctx.hub.forget(run)  # no page, old or new, follows it or calls it failed any more
    labels = ctx.run_labels()
    return [f"Deleted **{label}** ({run}).", table(ctx), update(choices=labels, value=None), update(value=False)]


def _load_settings(ctx: UIContext, label: str | None) -> list[Any]:
    run = ctx.run_path(label)
    try:
        with open(RunPaths(run).config, "rb") as f:
            values = tomllib.load(f)
    except (OSError, ValueError, TypeError):
        return [f"⚠ {label or 'No run'} has no readable config.toml.", *ctx.form.updates({})]
    values.pop("output_dir", None)  # Start makes a new run folder; Resume continues this one
    known = {k: v for k, v in values.items() if k in ctx.form.components}
    return [f"Loaded the {len(known)} settings of **{label}** into the form; Start makes a new run with them.",
            *ctx.form.updates(known)]


def zip_checkpoint(run: Path) -> Path | None:
    """The newest checkpoint of `run` as RUN/downloads/step_NNNNNN.zip (made once), or None."""
    checkpoints = RunReader(run).checkpoints()
    if not checkpoints:
        return None
    target = RunPaths(run).root / "downloads" / f"{checkpoints[-1].name}.zip"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = shutil.make_archive(str(target.with_suffix("")) + ".partial", "zip", checkpoints[-1])
        Path(partial).replace(target)
    return target


def _zip(ctx: UIContext, label: str | None) -> list[Any]:
    run = ctx.run_path(label)
    archive = zip_checkpoint(run) if run else None
    if archive is None:
        return [f"⚠ {label or 'No run chosen'}: no checkpoint to download.", unchanged()]
    files = [*(_choose(ctx, label) or []), str(archive)]
    return [f"Newest checkpoint of **{label}** zipped: {archive.name} (below).", files]


def wire(ctx: UIContext) -> None:
    p = ctx.parts
    listen(p["runs.delete"].click, lambda label, ok: _delete(ctx, label, ok), [p["runs.choice"], p["runs.confirm"]],
           [p["runs.message"], p["runs.table"], p["runs.choice"], p["runs.confirm"]])
    listen(p["runs.load"].click, lambda label: _load_settings(ctx, label), [p["runs.choice"]],
           [p["runs.message"], *ctx.form.inputs])
    listen(p["runs.zip"].click, lambda label: _zip(ctx, label), [p["runs.choice"]], [p["runs.message"], p["runs.files"]])
    listen(p["runs.refresh"].click, lambda label: _refresh(ctx, label), [p["runs.choice"]],
           [p["runs.table"], p["runs.choice"], p["runs.files"]])
    listen(p["runs.choice"].change, lambda label: _choose(ctx, label), [p["runs.choice"]], [p["runs.files"]])
    listen(p["runs.choice"].change, lambda label: tensorboard_hint(ctx.run_path(label)), [p["runs.choice"]],
           [p["runs.tensorboard"]])
    listen(p["runs.attach"].click, lambda label: _attach(ctx, label), [p["runs.choice"]],
           [p["runs.message"], p["train.run"]])


def live_inputs(ctx: UIContext) -> list[Any]:
    return [ctx.parts["runs.choice"]]


def live_outputs(ctx: UIContext) -> list[Any]:
    return [ctx.parts["runs.table"], ctx.parts["runs.choice"]]


def refresh(ctx: UIContext, seen: dict[str, Any], chosen: str | None = None) -> list[Any]:
    """The table and the run dropdown under it change together: a run that appears (started here, by the
    queue, from the CLI) or goes is in both at the same tick. The chosen run stays unless it was deleted."""
    frame = table(ctx)
    key = frame.to_json()
    if seen.get("runs") == key:
        return [unchanged(), unchanged()]
    seen["runs"] = key
    labels = list(frame["run"])
    choice = update(choices=labels) if chosen in labels or not chosen else update(choices=labels, value=None)
    return [frame, choice]
