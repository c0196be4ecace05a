"""Train tab: start a run from the form, steer it (stop, pause, continue, save now), resume an old one,
and watch its status line and log."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import gradio as gr

from ..compat import listen, make, unchanged, update, user_change
from ..context import UIContext
from ..status import run_status, status_line, stop_state
from ..validation import memory_estimate
from .model import accordions, check, group_marks, problems_text
from stabletune_core import runqueue
from stabletune_core.launch import LaunchError, write_run_config
from stabletune_core.runs.layout import RunPaths
from stabletune_core.runs.reader import log_tail

try:  # Python 3.11+; A1111 hosts may run 3.10 with tomli
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - depends on the host
    import tomli as tomllib  # type: ignore[no-redef]

TITLE = "Train"
CONTROLS = (("pause", "Pause"), ("resume", "Continue"), ("save", "Save checkpoint now"), ("sample", "Sample now"),
            ("stop", "Stop (saves)"))
LIVE_STATES_TEXT = "Stop, pause or save act on the attached run between two steps."


def build(ctx: UIContext) -> None:
    p = ctx.parts
    p["train.status"] = make(gr.Markdown, value=status_line("", {"state": "none"}, None), elem_id="train-status")
    with gr.Row():
        with make(gr.Column, scale=3):
            ctx.form.build(["output_dir"], value="", placeholder=str(ctx.settings.runs_dir / "my-lora"),
                           info=f"The run directory. Empty = a new folder in {ctx.settings.runs_dir}; an "
                                "existing run's folder gets a -2, -3 ... suffix (use Resume to continue it).")
        with make(gr.Column, scale=2):
            p["train.run"] = make(gr.Dropdown, label="Attached run (status, plots and samples follow it)",
                                  choices=ctx.run_labels(), value=None, elem_id="train-run",
                                  # checked by ctx.followed, not by Gradio: its copy of the choices may lag a tick
                                  # behind a run that was just started or deleted, and would refuse the event
                                  allow_custom_value=True)
    with gr.Row():
        p["train.start"] = make(gr.Button, value="Start training", variant="primary", elem_id="train-start")
        for command, label in CONTROLS:
            p[f"train.{command}"] = make(gr.Button, value=label, variant="stop" if command == "stop" else "secondary",
                                         elem_id=f"train-{command}")
        p["train.continue_run"] = make(gr.Button, value="Resume run from checkpoint",
                                       elem_id="train-resume-run")
        p["train.enqueue"] = make(gr.Button, value="Add to queue", elem_id="train-enqueue")  # wired in tabs/queue
    p["train.progress"] = make(gr.HTML, value=progress_bar({"state": "none"}), elem_id="train-progress")
    p["train.message"] = make(gr.Markdown, value=LIVE_STATES_TEXT, elem_id="train-message")
    with make(gr.Accordion, label="Engine log (train.log, last lines)", open=False):
        p["train.log"] = make(gr.Textbox, label="train.log", lines=12, max_lines=12, interactive=False,
                              elem_id="train-log")


def progress_bar(status: dict[str, Any]) -> str:
    """A progress bar of step / max_steps (empty when nothing is attached or the length is unknown)."""
    step, total = int(status.get("step") or 0), status.get("max_steps")
    if status.get("state") == "none" or not total:
        return ""
    percent = max(0.0, min(100.0, 100.0 * step / float(total)))
    colour = {"failed": "#d9534f", "finished": "#5cb85c"}.get(status.get("state"), "var(--color-accent, #f97316)")
    return (f'<div class="stabletune-progress" role="progressbar" aria-valuenow="{step}" aria-valuemin="0" '
            f'aria-valuemax="{int(total)}" title="step {step} of {int(total)}" style="height:10px;border-radius:5px;'
            f'background:var(--border-color-primary, #ddd);overflow:hidden"><div style="height:100%;'
            f'width:{percent:.1f}%;background:{colour}"></div></div>')


def buttons_for(status: dict[str, Any], has_checkpoint: bool) -> dict[str, bool]:
    """Which Train buttons make sense in this state (the others are disabled). Once a stop is asked for, only
    Stop stays: the engine reads one command at a time, and a later one would replace the stop."""
    live = bool(status.get("alive"))
    paused = status.get("state") == "paused" or bool(status.get("paused"))
    steer = live and not status.get("stop")
    return {"start": not live, "pause": steer and not paused, "resume": steer and paused, "save": steer,
            "sample": steer, "stop": live, "continue_run": not live and has_checkpoint}


free_run_dir = runqueue.free_run_dir  # starting never overwrites an earlier run (resume continues one)


def _launch(ctx: UIContext, values: dict[str, Any]) -> tuple[str, Path | None]:
    """Write the config into the run folder and spawn the engine: (the message for the user, the run started)."""
    try:
        runqueue.refuse_if_busy(ctx.settings.runs_dir, values.get("output_dir") or "")  # before a folder is made
        run_dir = write_run_config(values, ctx.settings.engine_python)
        host_note = ctx.settings.before_start(run_dir) if ctx.settings.before_start else None  # WebUI: unload
        process = runqueue.start_trainer(ctx.settings.runs_dir, run_dir, ctx.settings.engine_python,
                                         ctx.settings.num_processes)  # one trainer at a time, the queue's too
    except LaunchError as exc:
        return "**Not started:**\n\n" + "\n".join(f"- ⚠ {ctx.form.labelled(p)}" for p in exc.problems), None
    except runqueue.QueueError as exc:
        return f"⚠ **Not started:** {exc}", None
    ctx.hub.started(run_dir, process)
    return (f"Started **{ctx.run_label(run_dir)}** (engine pid {process.pid}); log in {RunPaths(run_dir).log}."
            + (f"\n\n{host_note}" if host_note else "")), run_dir


def _start(ctx: UIContext, *raw: Any) -> list[Any]:
    live = next((r.path for r in ctx.hub.runs() if ctx.hub.is_live(r.path)), None)
    if live:
        return [f"⚠ **{ctx.run_label(live)}** is still running; stop it first (one run per machine).",
                unchanged(), unchanged(), *ctx.form.updates({}), *(unchanged() for _ in accordions(ctx))]
    values, problems, notes = check(ctx, raw)
    started = None
    if not problems:
        values["output_dir"] = str(runqueue.new_run_dir(values, ctx.settings.runs_dir))
        memory = memory_estimate(values, ctx.settings.engine_python)
        message, started = _launch(ctx, values)
        if notes or memory:
            message += "\n\n" + problems_text([], notes, ctx.form, started=True, memory=memory)
    else:
        message = problems_text(problems, notes, ctx.form)
    # The page follows the run it started: its dropdown says so (a refresh tick never sets it back, see refresh).
    follow = update(choices=ctx.run_labels(started), value=ctx.run_label(started)) if started else unchanged()
    return [message, update(value=values.get("output_dir", "")) if not problems else unchanged(), follow,
            *ctx.form.problem_updates(problems, notes), *group_marks(ctx, problems)]


def _control(ctx: UIContext, command: str, label: str | None = None) -> str:
    run = ctx.followed(label)
    if run is None or not ctx.hub.is_live(run):
        return "⚠ No live run is attached; start one or attach a running one in **Runs**."
    reader = ctx.hub.reader(run)
    if command != "stop" and stop_state(reader.paths.control, reader.events()):
        return f"⚠ {ctx.run_label(run)} is stopping; **{command}** was not sent (it would replace the stop)."
    reader.send(command)
    if command == "stop":
        return (f"⏹ **Stop requested** for {ctx.run_label(run)}: the engine saves a checkpoint and the LoRA, then "
                "stops (after the step, or the validation images, it is making now).")
    return f"Sent **{command}** to {ctx.run_label(run)}; the engine acts on it after the current step."


def _continue_run(ctx: UIContext, label: str | None = None) -> list[Any]:
    run = ctx.followed(label)
    if run is None:
        return ["⚠ Attach a run first (dropdown above or the **Runs** tab).", unchanged(), unchanged()]
    if ctx.hub.is_live(run):
        return [f"⚠ {ctx.run_label(run)} is still running.", unchanged(), unchanged()]
    config = RunPaths(run).config
    if not config.is_file():
        return [f"⚠ {ctx.run_label(run)} has no config.toml to resume from.", unchanged(), unchanged()]
    with open(config, "rb") as f:
        values = tomllib.load(f)
    values.update(resume_from_checkpoint="auto", output_dir=str(run))
    message, _ = _launch(ctx, values)
    return [message, update(choices=ctx.run_labels(run), value=ctx.run_label(run)), status_now(ctx, run)]


def status_now(ctx: UIContext, run: Path | None) -> str:
    """The run's status line right away (not at the next refresh)."""
    if run is None:
        return status_line("", {"state": "none"}, None)
    status, events = run_status(ctx.hub, run)
    return status_line(ctx.run_label(run), status, events[-1] if events else None)


def _attach(ctx: UIContext, label: str | None) -> Any:
    """Only this browser follows the chosen run (its dropdown value); other browsers keep theirs."""
    return f"Attached **{label}**." if label else LIVE_STATES_TEXT


def wire(ctx: UIContext) -> None:
    p, form = ctx.parts, ctx.form
    listen(p["train.start"].click, lambda *raw: _start(ctx, *raw), form.inputs,
           [p["train.message"], form.components["output_dir"], p["train.run"], *form.inputs, *accordions(ctx)])
    for command, _ in CONTROLS:  # the status line answers at once (a stop shows as requested), not at the next tick
        listen(p[f"train.{command}"].click,
               lambda label, c=command: [_control(ctx, c, label), status_now(ctx, ctx.followed(label))],
               [p["train.run"]], [p["train.message"], p["train.status"]])
    listen(p["train.continue_run"].click, lambda label: _continue_run(ctx, label), [p["train.run"]],
           [p["train.message"], p["train.run"], p["train.status"]])
    listen(user_change(p["train.run"]), lambda label: _attach(ctx, label), [p["train.run"]], [p["train.message"]])


def run_dropdown(ctx: UIContext, seen: dict[str, Any], run: Path | None) -> Any:
    """The update a refresh tick sends to this browser's run dropdown: new choices when runs came or went, and a
    value only when the page follows another run than the dropdown shows (nothing chosen yet, a deleted run, the
    queue moved on to its next run; see ui._live).

    Never the value the browser sent: a tick's inputs are read before a Start (or a choice) lands and its reply
    may arrive after it, so sending the followed run back would switch the page to the old run again."""
    labels = ctx.run_labels(run)
    changes: dict[str, Any] = {}
    if labels != seen.get("train.runs"):
        seen["train.runs"] = labels
        changes["choices"] = labels
    shown = seen.get("label")
    if ctx.run_label(run) != shown and ctx.run_path(shown) != run:
        changes["value"] = ctx.run_label(run)
        changes.setdefault("choices", labels)
    return update(**changes) if changes else unchanged()


BUTTONS = ("start", "pause", "resume", "save", "sample", "stop", "continue_run")


def live_outputs(ctx: UIContext) -> list[Any]:
    return [ctx.parts["train.status"], ctx.parts["train.log"], ctx.parts["train.run"], ctx.parts["train.progress"],
            *(ctx.parts[f"train.{b}"] for b in BUTTONS)]


def refresh(ctx: UIContext, seen: dict[str, Any]) -> list[Any]:
    run = ctx.run_of(seen)
    dropdown = run_dropdown(ctx, seen, run)
    if run is None:
        status, line, log, has_checkpoint = {"state": "none"}, status_line("", {"state": "none"}, None), "", False
    else:
        reader = ctx.hub.reader(run)
        status, events = run_status(ctx.hub, run)  # the speed without paused time, a pending stop, images made
        line = status_line(ctx.run_label(run), status, events[-1] if events else None)
        note = ctx.settings.run_note(run) if ctx.settings.run_note else None
        line += f"\n\n{note}" if note else ""
        log, has_checkpoint = log_tail(run), bool(reader.checkpoints())
    enabled = buttons_for(status, has_checkpoint)
    buttons = [unchanged()] * len(BUTTONS)
    if seen.get("train.buttons") != enabled:  # only send what changed: a button mid-click keeps its state
        seen["train.buttons"] = enabled
        buttons = [update(interactive=enabled[b]) for b in BUTTONS]
    return [line, log, dropdown, progress_bar(status), *buttons]
