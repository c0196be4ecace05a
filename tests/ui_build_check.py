"""Build the StableTune Blocks under whatever Gradio this interpreter has; print one JSON line.

Run by tests/test_ui_build.py with the main venv and, when they exist, the light venvs .venv-g440
(Forge's Gradio 4.40) and .venv-g341 (A1111's Gradio 3.41, pydantic 1). None of them may import torch:
the light venvs do not even have it.
"""
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gradio as gr  # noqa: E402

from extension.settings import UISettings  # noqa: E402
from extension.ui import build_ui  # noqa: E402


def ticks_follow_the_first_paint(blocks: gr.Blocks) -> bool:
    """Do the refresh ticks start only after the first paint, which follows the restore of the browser's saved
    run? (A tick before it sends the default "no run chosen", and its reply could undo the restore.) Read from
    the config the browser gets, which every Gradio here has: 3.41 names the trigger and indexes `trigger_after`
    by position, later ones give (id, event) targets and dependency ids."""
    config = blocks.get_config_file() if hasattr(blocks, "get_config_file") else blocks.config
    deps = config["dependencies"]
    by_id = {dep.get("id", i): dep for i, dep in enumerate(deps)}
    ids = {c["id"]: c.get("props", {}).get("elem_id") for c in config["components"]}
    types = {c["id"]: c.get("type") for c in config["components"]}

    def on_load(dep: dict) -> bool:
        return dep.get("trigger") == "load" or any(t[1] == "load" for t in dep.get("targets") or [] if t)

    def shows_run_picker(dep: dict) -> bool:
        return "train-run" in {ids.get(o) for o in dep["outputs"]}

    starters = [d for d in deps
                if "timer" in {types.get(o) for o in d["outputs"]} or "stabletuneTick" in str(d.get("js"))]
    timers = [c for c in config["components"] if c.get("type") == "timer"]
    if len(starters) != 1 or any(t.get("props", {}).get("active", True) for t in timers) or on_load(starters[0]):
        return False
    first_paint = by_id.get(starters[0].get("trigger_after"))
    restore = by_id.get(first_paint.get("trigger_after")) if first_paint else None
    return bool(first_paint and restore and shows_run_picker(first_paint) and on_load(restore)
                and shows_run_picker(restore))


with tempfile.TemporaryDirectory() as runs:
    blocks = build_ui(UISettings(runs_dir=Path(runs)))
    assert isinstance(blocks, gr.Blocks)
    assert "torch" not in sys.modules, "the UI process imported torch"
    print(json.dumps({"gradio": gr.__version__, "components": len(blocks.blocks), "torch": "torch" in sys.modules,
                      "ticks_follow_the_first_paint": ticks_follow_the_first_paint(blocks),
                      "schema": "config" if "stabletune_core.config" in sys.modules else "json"}))
