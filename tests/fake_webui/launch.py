"""Fake of the WebUI's launch module: what extensions' install.py files use. Nothing is installed."""
import subprocess
import sys
from importlib import metadata

from _log import record

python = sys.executable


def is_installed(package: str) -> bool:
    try:
        metadata.version(package)
    except metadata.PackageNotFoundError:
        return False
    return True


def run_pip(command: str, desc: str = None, live: bool = False) -> str:
    # The real one runs `python -m pip install ...` in the WebUI's venv: StableTune must never call it.
    record("launch.run_pip", command=command, desc=desc)
    return ""


def run(command: str, desc: str = None, errdesc: str = None, custom_env: dict = None, live: bool = False) -> str:
    record("launch.run", command=command)
    return ""
