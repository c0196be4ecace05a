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

with tempfile.TemporaryDirectory() as runs:
    blocks = build_ui(UISettings(runs_dir=Path(runs)))
    assert isinstance(blocks, gr.Blocks)
    assert "torch" not in sys.modules, "the UI process imported torch"
    print(json.dumps({"gradio": gr.__version__, "components": len(blocks.blocks), "torch": "torch" in sys.modules,
                      "schema": "config" if "stabletune_core.config" in sys.modules else "json"}))
