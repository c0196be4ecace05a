"""Install what StableTune's engine needs into this Python, skipping what is already there.

    python install.py          # the engine and the UI
    python install.py --dev    # plus the test tools

Idempotent: a second run installs nothing. torch and torchvision are pinned together (requirements.txt);
an unpinned torch would pull gigabytes of a newer build.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent


def read_requirements(path: Path) -> list[str]:
    lines = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-r "):
            lines += read_requirements(path.parent / line[3:].strip())
        else:
            lines.append(line)
    return lines


def missing(requirements: list[str]) -> list[str]:
    """Requirements whose exact pinned version is not installed."""
    wanted = []
    for requirement in requirements:
        name, _, version = re.split(r"(==)", requirement, maxsplit=1) if "==" in requirement else (requirement, "", "")
        try:
            installed = metadata.version(name.strip())
        except metadata.PackageNotFoundError:
            wanted.append(requirement)
            continue
        if version and installed.split("+")[0] != version.strip():
            wanted.append(requirement)
    return wanted


def pip_install(requirements: list[str]) -> None:
    print(f"StableTune install: pip install {' '.join(requirements)}", flush=True)
    subprocess.check_call([sys.executable, "-m", "pip", "install", *requirements])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dev", action="store_true", help="Also install the test tools (pytest, playwright).")
    args = parser.parse_args(argv)
    if sys.prefix == sys.base_prefix:
        print("StableTune install: note: this Python is not a virtual environment; consider "
              "`python -m venv .venv` first so StableTune's pins do not touch other projects.")
    requirements = read_requirements(ROOT / ("requirements-dev.txt" if args.dev else "requirements.txt"))
    todo = missing(requirements)
    if todo:
        pip_install(todo)
    print("StableTune install: everything is in place.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
