"""Queue tab: runs configured in the form wait here and train one after another (stabletune_core/runqueue.py).

The queue lives in the runs folder and its worker is a process of its own, so a UI restart neither loses nor
stops it; the Train tab's **Add to queue** puts the form's settings at its end. Waiting entries can be moved and
removed; a failed run does not stop the queue; there is one trainer at a time on this machine.
"""
from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

from ..compat import listen, make, unchanged, update
from ..context import UIContext
from .model import check, group_marks, problems_text
from stabletune_core import runqueue
from stabletune_core.launch import LaunchError

TITLE = "Queue"
COLUMNS = ["#", "name", "state", "run folder", "added", "note"]


def build(ctx: UIContext) -> None:
    p = ctx.parts
    p["queue.status"] = make(gr.Markdown, value=status_text(ctx), elem_id="queue-status")
    p["queue.table"] = make(gr.Dataframe, value=table(ctx), headers=COLUMNS, interactive=False, wrap=True,
                            label="Queue (top runs first)", column_widths=["6%", "20%", "10%", "30%", "12%", "22%"],
                            elem_id="queue-table")
    with gr.Row():
        p["queue.entry"] = make(gr.Dropdown, label="Waiting entry", choices=entry_choices(ctx), value=None, scale=3,
                                allow_custom_value=True, elem_id="queue-entry")
        p["queue.up"] = make(gr.Button, value="Move up", scale=1, elem_id="queue-up")
        p["queue.down"] = make(gr.Button, value="Move down", scale=1, elem_id="queue-down")
        p["queue.remove"] = make(gr.Button, value="Remove", variant="stop", scale=1, elem_id="queue-remove")
    with gr.Row():
        p["queue.run"] = make(gr.Button, value="Run the queue", variant="primary", elem_id="queue-run")
        p["queue.hold"] = make(gr.Button, value="Hold: start nothing after the running entry", elem_id="queue-hold")
    p["queue.message"] = make(gr.Markdown, value="Add runs with **Add to queue** in the Train tab: each takes the "
                              "form's settings as they are when you click.", elem_id="queue-message")


# ---- what the tab shows ----------------------------------------------------------------------------------------
def table(ctx: UIContext) -> pd.DataFrame:
    rows = []
    for e in runqueue.read_for_display(ctx.settings.runs_dir)[0].entries:
        added = datetime.datetime.fromtimestamp(e.added_at).strftime("%H:%M:%S") if e.added_at else ""
        rows.append([e.id, e.name, e.state, ctx.run_label(Path(e.run)) if e.run else "", added, e.error or ""])
    return pd.DataFrame(rows, columns=COLUMNS)


def entry_choices(ctx: UIContext) -> list[str]:
    return [f"#{e.id} {e.name}" for e in runqueue.read_for_display(ctx.settings.runs_dir)[0].waiting()]


def entry_id(choice: str | None) -> int | None:
    try:
        return int(str(choice or "").split(" ", 1)[0].lstrip("#"))
    except ValueError:
        return None


def status_text(ctx: UIContext) -> str:
    queue, damaged = runqueue.read_for_display(ctx.settings.runs_dir)
    if damaged:
        return f"**Queue:** ⚠ {damaged}"
    waiting, running = len(queue.waiting()), queue.running()
    if not queue.entries:
        return "**Queue:** empty. **Add to queue** (Train tab) puts the form's run here; they train one after another."
    if running is not None:
        head = f"**Queue:** training #{running.id} **{running.name}**"
    elif not waiting:  # a worker still alive here is only exiting: it has nothing left to start
        head = "**Queue:** done"
    elif runqueue.worker_alive(ctx.settings.runs_dir):
        head = "**Queue:** running (waiting for the run that trains now to end)"
    else:
        head = "**Queue:** held" if queue.hold else "**Queue:** not running"
        head += " — click **Run the queue**"
    return f"{head} · {waiting} waiting · {len(queue.entries) - waiting - (running is not None)} done"


# ---- actions -----------------------------------------------------------------------------------------------------
def _enqueue(ctx: UIContext, *raw: Any) -> list[Any]:
    """The form's settings as a new waiting entry (checked as Start checks them), then the queue runs."""
    values, problems, notes = check(ctx, raw)
    if not problems:
        try:
            entry = add_entry(ctx, values)
        except LaunchError as exc:
            problems = exc.problems
        except runqueue.QueueError as exc:
            return [f"**Not queued:** ⚠ {exc}", *ctx.form.problem_updates([], notes), *group_marks(ctx, [])]
    if problems:
        return ["**Not queued:**\n\n" + "\n".join(f"- ⚠ {ctx.form.labelled(p)}" for p in problems),
                *ctx.form.problem_updates(problems, notes), *group_marks(ctx, problems)]
    started = runqueue.start_worker(ctx.settings.runs_dir, ctx.settings.engine_python, ctx.settings.num_processes)
    message = f"Queued #{entry['id']} **{entry['name']}**. {started} (Queue tab: order, remove, state.)"
    if notes:
        message += "\n\n" + problems_text([], notes, ctx.form, started=True)
    return [message, *ctx.form.problem_updates([], notes), *group_marks(ctx, [])]


def add_entry(ctx: UIContext, values: dict[str, Any]) -> dict[str, Any]:
    """Add in this process when it can build the config (pydantic 2), else through the engine's Python (an
    AUTOMATIC1111 host has pydantic 1). Returns {"id", "name"}; raises LaunchError with the problems."""
    try:
        import stabletune_core.config  # noqa: F401  (pydantic 2 here?)
    except ImportError:  # pragma: no cover - an AUTOMATIC1111 host
        return _add_through_engine(ctx, values)
    entry = runqueue.add(ctx.settings.runs_dir, values)
    return {"id": entry.id, "name": entry.name}


def _add_through_engine(ctx: UIContext, values: dict[str, Any]) -> dict[str, Any]:
    import json
    import subprocess

    from stabletune_core.launch import engine_env

    done = subprocess.run([ctx.settings.engine_python, "-m", "stabletune_core", "queue", "add", "--values-json",
                           "--no-start", "--runs-dir", str(ctx.settings.runs_dir)], input=json.dumps(values),
                          capture_output=True, text=True, env=engine_env(), timeout=300)
    if done.returncode:
        raise LaunchError([line[len("error: "):] for line in done.stderr.splitlines() if line.startswith("error: ")]
                          or [done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "queue add failed"])
    entry = runqueue.read(ctx.settings.runs_dir).entries[-1]
    return {"id": entry.id, "name": entry.name}


def _move(ctx: UIContext, choice: str | None, by: int) -> list[Any]:
    chosen = entry_id(choice)
    if chosen is None:
        return ["Choose a waiting entry first.", unchanged()]
    try:
        order = [e.id for e in runqueue.read(ctx.settings.runs_dir).waiting()]
        place = order.index(chosen) + 1 + by
        runqueue.move(ctx.settings.runs_dir, chosen, max(1, place))
    except (ValueError, runqueue.QueueError) as exc:
        return [f"⚠ {exc if isinstance(exc, runqueue.QueueError) else 'That entry is not waiting any more.'}",
                unchanged()]
    return [f"Moved {choice} {'up' if by < 0 else 'down'}.", update(choices=entry_choices(ctx), value=choice)]


def _remove(ctx: UIContext, choice: str | None) -> list[Any]:
    chosen = entry_id(choice)
    if chosen is None:
        return ["Choose a waiting entry first.", unchanged()]
    try:
        entry = runqueue.remove(ctx.settings.runs_dir, chosen)
    except runqueue.QueueError as exc:
        return [f"⚠ {exc}", unchanged()]
    return [f"Removed #{entry.id} **{entry.name}** from the queue.", update(choices=entry_choices(ctx), value=None)]


def _run(ctx: UIContext) -> str:
    try:
        runqueue.set_hold(ctx.settings.runs_dir, False)
    except runqueue.QueueError as exc:
        return f"⚠ {exc}"
    if not runqueue.read(ctx.settings.runs_dir).waiting():
        return "Nothing is waiting in the queue."
    return runqueue.start_worker(ctx.settings.runs_dir, ctx.settings.engine_python, ctx.settings.num_processes)


def _hold(ctx: UIContext) -> str:
    try:
        runqueue.set_hold(ctx.settings.runs_dir, True)
    except runqueue.QueueError as exc:
        return f"⚠ {exc}"
    return "The queue starts nothing after the run that trains now; **Run the queue** continues it."


def wire(ctx: UIContext) -> None:
    p, form = ctx.parts, ctx.form
    from .model import accordions

    listen(p["train.enqueue"].click, lambda *raw: _enqueue(ctx, *raw), form.inputs,
           [p["train.message"], *form.inputs, *accordions(ctx)])
    listen(p["queue.up"].click, lambda c: _move(ctx, c, -1), [p["queue.entry"]], [p["queue.message"], p["queue.entry"]])
    listen(p["queue.down"].click, lambda c: _move(ctx, c, 1), [p["queue.entry"]],
           [p["queue.message"], p["queue.entry"]])
    listen(p["queue.remove"].click, lambda c: _remove(ctx, c), [p["queue.entry"]],
           [p["queue.message"], p["queue.entry"]])
    listen(p["queue.run"].click, lambda: _run(ctx), None, [p["queue.message"]])
    listen(p["queue.hold"].click, lambda: _hold(ctx), None, [p["queue.message"]])


# ---- live ---------------------------------------------------------------------------------------------------------
def live_inputs(ctx: UIContext) -> list[Any]:
    return [ctx.parts["queue.entry"]]


def live_outputs(ctx: UIContext) -> list[Any]:
    return [ctx.parts["queue.status"], ctx.parts["queue.table"], ctx.parts["queue.entry"]]


def refresh(ctx: UIContext, seen: dict[str, Any], chosen: str | None = None) -> list[Any]:
    announce_started(ctx)
    frame, status = table(ctx), status_text(ctx)
    key = (frame.to_json(), status)
    if seen.get("queue") == key:
        return [unchanged(), unchanged(), unchanged()]
    seen["queue"] = key
    choices = entry_choices(ctx)
    entry = update(choices=choices) if chosen in choices or not chosen else update(choices=choices, value=None)
    return [status, frame, entry]


def announce_started(ctx: UIContext) -> None:
    """The host's hook for a run the queue started (a WebUI unloads its checkpoint and copies the LoRA when it
    ends), once per run: the worker is another process and cannot call into the WebUI."""
    hook = ctx.settings.before_start
    running = runqueue.read_for_display(ctx.settings.runs_dir)[0].running()
    if hook is None or running is None or not running.run or running.run in ctx.hub.announced:
        return
    ctx.hub.announced.add(running.run)
    hook(Path(running.run))
