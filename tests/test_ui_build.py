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
    assert report["ticks_follow_the_first_paint"], "a refresh tick can run before the saved run is restored"
    if name == "gradio-3.41":  # pydantic 1 there: the form must come from the committed JSON schema
        assert report["schema"] == "json"


def test_install_dev_leaves_the_webui_host_venvs_these_tests_use_and_a_second_run_builds_nothing():
    """The README's test line is `python install.py --dev && python -m pytest`: --dev must leave the light venvs
    that play Forge's and A1111's Gradio here (a fresh clone once failed 9 UI tests for want of them), and must
    not rebuild them when they are already right."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("stabletune_install", ROOT / "install.py")
    install = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(install)
    for name, (version, _) in install.WEBUI_TEST_VENVS.items():
        python = install.venv_python(install.ROOT / name)
        assert python in VENVS.values(), name
        shown = subprocess.run([str(python), "-c", "import gradio; print(gradio.__version__)"], capture_output=True,
                               text=True)
        assert shown.stdout.strip() == version, (name, shown.stderr[-500:])
    assert install.start_webui_test_venvs() == []
