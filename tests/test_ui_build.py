"""The UI builds without torch on current Gradio and, when their light venvs exist, on Forge's Gradio 4.40
and A1111's Gradio 3.41 (created by CI: see tests/ui_build_check.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ui_tools import require

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "tests" / "ui_build_check.py"
VENVS = {"current": Path(sys.executable), "gradio-4.40": ROOT / ".venv-g440" / "bin" / "python",
         "gradio-3.41": ROOT / ".venv-g341" / "bin" / "python"}


@pytest.mark.parametrize("name", list(VENVS))
def test_blocks_build_without_torch(name: str) -> None:
    python = VENVS[name]
    require(python.exists(), f"{python} does not exist")
    done = subprocess.run([str(python), str(CHECK)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["torch"] is False
    assert report["components"] > 100
    if name == "gradio-3.41":  # pydantic 1 there: the form must come from the committed JSON schema
        assert report["schema"] == "json"
