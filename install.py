"""Install what StableTune's engine needs, skipping what is already there.

Standalone, into the Python that runs this file:

    python install.py          # the engine and the UI
    python install.py --dev    # plus the test tools, and the light venvs .venv-g440 / .venv-g341 (no torch)
                               # that play Forge's and A1111's Gradio in the UI tests

Inside AUTOMATIC1111 / Forge (the WebUI runs `<extension>/install.py` with its own Python at every start):
the WebUI's venv is never changed. If it already has the engine's pins, the trainer runs in it; otherwise
a private venv `<extension>/.venv-engine` gets the pins, reusing the WebUI's torch (and torchvision, numpy)
when that torch is new enough. The chosen trainer Python is written to `stabletune-engine.json`, which the
tab reads. `python install.py --webui --dry-run` prints that plan without doing anything.

Idempotent: a second run installs nothing. torch and torchvision are pinned together (requirements.txt);
an unpinned torch would pull gigabytes of a newer build.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent
ENGINE_VENV = ROOT / ".venv-engine"
ENGINE_RECORD = ROOT / "stabletune-engine.json"  # read by extension/webui.py
# The WebUI draws the tab with its own Gradio; the engine never imports these.
UI_ONLY = ("gradio", "pandas", "matplotlib")
# Packages tied to the host's torch build (CUDA wheels, C ABI): a host version at least this new is reused
# instead of installing the pin next to it. torch >= 2.6 because the pinned accelerate requires it.
REUSE_MINIMUM = {"torch": "2.6", "torchvision": "0.21", "numpy": "1.26"}
# The pinned diffusers, transformers and accelerate require Python >= 3.11 (the variable is a test hook).
ENGINE_MIN_PYTHON = tuple(int(p) for p in os.environ.get("STABLETUNE_ENGINE_MIN_PYTHON", "3.11").split("."))
PYTHON_CANDIDATES = ("python3.13", "python3.12", "python3.11", "python3")
# Reused only together with the host's torch (a torchvision build matches one torch).
COUPLED = {"torchvision": "torch"}
# Prints one JSON object {name: installed version or null} for the names in argv, in any Python >= 3.8.
VERSIONS_SNIPPET = """
import json, sys
from importlib import metadata
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
print(json.dumps({name: version(name) for name in sys.argv[1:]}))
"""
SITE_SNIPPET = ("import json, site, sysconfig; "
                "print(json.dumps([site.getsitepackages(), sysconfig.get_paths()['purelib']]))")


def say(message: str) -> None:
    print(f"StableTune install: {message}", flush=True)


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


def split_pin(requirement: str) -> tuple[str, str]:
    """("torch", "2.14.1") for "torch==2.14.1"; ("tqdm", "") for an unpinned name."""
    name, _, version = requirement.partition("==")
    return name.strip(), version.strip()


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


# ---- the WebUI hook --------------------------------------------------------------------------------------
def in_webui() -> bool:
    """True when a WebUI runs this file: its `launch` module is importable (A1111 and Forge put their
    folder on PYTHONPATH for install.py). STABLETUNE_WEBUI=1/0 overrides the guess."""
    forced = os.environ.get("STABLETUNE_WEBUI")
    if forced is not None:
        return forced not in ("", "0")
    try:
        import launch  # type: ignore[import-not-found]
    except Exception:  # not a WebUI, or a WebUI whose launch module fails outside its own start-up
        return False
    return hasattr(launch, "run_pip") and hasattr(launch, "is_installed")


def release(version: str) -> tuple[int, ...]:
    """(2, 3, 1) for "2.3.1+cu121": enough to compare the release versions of the packages above."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = re.match(r"\d+", piece)
        if not digits:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


def acceptable(requirement: str, versions: dict[str, str | None]) -> bool:
    """Does an environment with these installed `versions` satisfy `requirement` for the engine?

    Pure-Python libraries must be the pinned version (the tested stack); the torch family may be any
    version from REUSE_MINIMUM on, since replacing it costs gigabytes or breaks the host's C extensions.
    """
    name, pin = split_pin(requirement)
    installed = versions.get(name)
    if installed is None:
        return False
    if name in COUPLED and not acceptable(f"{COUPLED[name]}==", versions):
        return False
    if name in REUSE_MINIMUM:
        return release(installed) >= release(REUSE_MINIMUM[name])
    return not pin or installed.split("+")[0] == pin


def versions_in(python: str, names: list[str]) -> dict[str, str | None]:
    """Installed versions of `names` as `python` sees them (this process needs no subprocess)."""
    if python == sys.executable:
        return {name: _local_version(name) for name in names}
    return json.loads(subprocess.check_output([python, "-c", VERSIONS_SNIPPET, *names], text=True))


def _local_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def engine_requirements(path: Path) -> list[str]:
    return [r for r in read_requirements(path) if split_pin(r)[0].lower() not in UI_ONLY]


def write_record(record: dict) -> None:
    """stabletune-engine.json, rewritten only when it changes (a WebUI start must not touch the folder)."""
    text = json.dumps(record, indent=2, sort_keys=True) + "\n"
    if ENGINE_RECORD.is_file() and ENGINE_RECORD.read_text() == text:
        return
    tmp = ENGINE_RECORD.with_suffix(".json.tmp")
    tmp.write_text(text)
    os.replace(tmp, ENGINE_RECORD)
    say(f"recorded the trainer's Python in {ENGINE_RECORD.name}")


def recorded_engine() -> str | None:
    """The trainer Python a finished install recorded, if any."""
    try:
        return json.loads(ENGINE_RECORD.read_text()).get("engine_python")
    except (OSError, ValueError):
        return None


def share_packages(engine_python: Path, base_python: str) -> None:
    """Let the engine venv see the base environment's packages, after its own.

    `venv --system-site-packages` would share the *base interpreter's* packages, not those of the WebUI's
    venv (A1111 runs in webui/venv), so the base's site-packages folders go into a .pth file instead:
    same effect, the engine venv's own pins still come first, and pip never uninstalls anything there
    (it only removes packages inside the environment it installs into).
    """
    base_sites, _ = json.loads(subprocess.check_output([base_python, "-c", SITE_SNIPPET], text=True))
    _, engine_site = json.loads(subprocess.check_output([str(engine_python), "-c", SITE_SNIPPET], text=True))
    pth = Path(engine_site) / "stabletune_host_packages.pth"
    text = "".join(f"{p}\n" for p in base_sites if Path(p).resolve() != Path(engine_site).resolve())
    if not pth.is_file() or pth.read_text() != text:
        pth.write_text(text)
        say(f"the engine venv reuses the packages of {base_python} ({', '.join(base_sites)})")


def python_version(python: str) -> tuple[int, ...] | None:
    """(3, 11) for a working interpreter, None for a missing or broken one (e.g. a pyenv shim of nothing)."""
    try:
        out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True,
                             text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return tuple(int(p) for p in out.stdout.split()) if out.returncode == 0 and out.stdout.strip() else None


def engine_creator(base_python: str) -> tuple[str | None, bool]:
    """(the Python that creates the engine venv, whether that venv shares `base_python`'s packages).

    The pinned diffusers, transformers and accelerate need Python >= ENGINE_MIN_PYTHON, and A1111/Forge
    run 3.10: then a newer Python from PATH makes an isolated venv (packages of another Python version
    cannot be shared). None when there is no such Python.
    """
    if (python_version(base_python) or ()) >= ENGINE_MIN_PYTHON:
        return base_python, True
    for name in PYTHON_CANDIDATES:
        found = shutil.which(name)
        if found and (python_version(found) or ()) >= ENGINE_MIN_PYTHON:
            return found, False
    return None, False


def webui_install(requirements_file: Path, base_python: str, dry_run: bool) -> int:
    requirements = engine_requirements(requirements_file)
    names = [split_pin(r)[0] for r in requirements]
    host = versions_in(sys.executable, names)
    if all(acceptable(r, host) for r in requirements):
        say(f"the WebUI's Python ({sys.executable}) already has the engine's packages; training runs in it.")
        if not dry_run:
            write_record({"engine_python": sys.executable, "mode": "host"})
        return 0

    engine = venv_python(ENGINE_VENV)
    if engine.exists() and recorded_engine() == str(engine):
        # A finished install (every WebUI start after the first): check the engine venv itself, quietly.
        still = [r for r in requirements if not acceptable(r, versions_in(str(engine), names))]
        if not still:
            say(f"the engine venv {ENGINE_VENV} has the engine's packages; nothing to install.")
            return 0
        say(f"the engine venv {ENGINE_VENV} lacks {', '.join(still)}.")
    lacking = ", ".join(r for r in requirements if not acceptable(r, host))
    say(f"the WebUI's Python lacks the engine's pins ({lacking}); the engine gets its own venv, {ENGINE_VENV}. "
        "The WebUI's venv is not changed.")
    wanted = ".".join(map(str, ENGINE_MIN_PYTHON))
    if engine.exists():  # it shares the base's packages exactly when it was made from the base's Python version
        creator, share = str(engine), python_version(str(engine)) == python_version(base_python)
    else:
        creator, share = engine_creator(base_python)
    if creator is None:
        say(f"error: the engine's pins (diffusers, transformers, accelerate) need Python >= {wanted}; {base_python} "
            f"is {'.'.join(map(str, python_version(base_python) or ())) or 'not runnable'} and no python{wanted} or "
            f"newer is on PATH. Install one and restart the WebUI, or set Settings > StableTune > Python that runs "
            f"the trainer to a Python prepared with `python install.py`. Nothing was changed.")
        return 1
    if not share:
        say(f"{base_python} is older than Python {wanted}: the engine venv is made from {creator} and cannot share "
            "the WebUI's packages.")
    base = (host if base_python == sys.executable else versions_in(base_python, names)) if share else {}
    reused = {split_pin(r)[0]: base[split_pin(r)[0]] for r in requirements if acceptable(r, base)}
    todo = [r for r in requirements if not acceptable(r, base)]
    if "torch" not in reused:
        torch = base.get("torch")
        found = (f"torch {torch} is older than {REUSE_MINIMUM['torch']}" if torch else "there is no torch") if share \
            else "torch cannot be shared"
        say(f"{found} (the pinned accelerate needs torch >= {REUSE_MINIMUM['torch']}): the engine venv installs "
            "its own torch (about 3 GB of wheels to download once; the venv takes about 5.5 GB).")
    if dry_run:
        say(("would create" if not engine.exists() else "would reuse") + f" {ENGINE_VENV}, reuse "
            f"{', '.join(f'{k} {v}' for k, v in reused.items()) or 'nothing'} from {base_python}, "
            f"and pip install {' '.join(todo) or 'nothing'}.")
        return 0

    try:
        if not engine.exists():
            say(f"creating {ENGINE_VENV} with {creator}")
            subprocess.check_call([creator, "-m", "venv", str(ENGINE_VENV)])
        if share:
            share_packages(engine, base_python)
        visible = versions_in(str(engine), names)
        todo = [r for r in requirements if not acceptable(r, visible)]
        if todo:
            # What the engine reuses stays exactly as it is: pip may not replace it inside the engine venv.
            keep = "".join(f"{n}=={visible[n]}\n" for n in reused if n in REUSE_MINIMUM and visible.get(n))
            with tempfile.TemporaryDirectory() as tmp:
                constraints = Path(tmp) / "constraints.txt"
                constraints.write_text(keep)
                say(f"pip install into the engine venv: {' '.join(todo)}")
                subprocess.check_call([str(engine), "-m", "pip", "install", "--disable-pip-version-check",
                                       "-c", str(constraints), *todo])
            visible = versions_in(str(engine), names)
        else:
            say("the engine venv already has everything; nothing to install.")
    except subprocess.CalledProcessError as exc:
        say(f"error: `{' '.join(map(str, exc.cmd[:4]))} ...` failed (exit {exc.returncode}, see above). The WebUI's "
            "venv was not changed; the next WebUI start tries again.")
        return 1
    still = [r for r in requirements if not acceptable(r, visible)]
    if still:
        say(f"error: after installing, the engine venv still lacks {', '.join(still)}.")
        return 1
    write_record({"engine_python": str(engine), "mode": "venv", "venv": str(ENGINE_VENV),
                  "base_python": base_python if share else creator,
                  "reused": {k: visible[k] for k in reused if visible.get(k)}})
    return 0


#: Light venvs (no torch) that play the WebUI hosts in tests/test_ui_build.py and test_webui_extension.py:
#: Forge's Gradio 4.40 and A1111's Gradio 3.41 with pydantic 1. The tests never skip for a missing one.
WEBUI_TEST_VENVS = {
    ".venv-g440": ("4.40.0", ["gradio==4.40.0", "huggingface_hub<0.26", "pandas", "matplotlib", "pydantic",
                              "tomli-w"]),
    ".venv-g341": ("3.41.2", ["gradio==3.41.2", "pandas", "matplotlib", "pydantic<2", "tomli-w"]),
}


def start_webui_test_venvs() -> list[tuple[str, subprocess.Popen, Path]]:
    """Start building the light test venvs that are missing or incomplete; they need no torch, so they are built
    while the main install runs. Returns (name, pip process, log file) per venv being built."""
    jobs = []
    for name, (version, packages) in WEBUI_TEST_VENVS.items():
        python = venv_python(ROOT / name)
        check = f"import gradio, sys; sys.exit(gradio.__version__ != {version!r})"
        if python.exists() and subprocess.run([str(python), "-c", check], capture_output=True).returncode == 0:
            continue
        say(f"building {name} (Gradio {version}, for the WebUI tests) in the background")
        subprocess.check_call([sys.executable, "-m", "venv", str(ROOT / name)])
        log = Path(tempfile.mkstemp(prefix=f"stabletune-{name}-", suffix=".log")[1])
        with open(log, "w") as out:
            pip = subprocess.Popen([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                    *packages], stdout=out, stderr=subprocess.STDOUT)
        jobs.append((name, pip, log))
    return jobs


def finish_webui_test_venvs(jobs: list[tuple[str, subprocess.Popen, Path]]) -> bool:
    """Wait for the builds; a failed one is one line and the tail of its pip log."""
    ok = True
    for name, pip, log in jobs:
        if pip.wait() != 0:
            say(f"error: could not build {name} (pip failed; the end of its log, {log}, follows).")
            print("\n".join(log.read_text(errors="replace").splitlines()[-20:]))
            ok = False
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dev", action="store_true", help="Also install the test tools (pytest, playwright).")
    parser.add_argument("--dry-run", action="store_true", help="Print what would be installed; change nothing.")
    parser.add_argument("--webui", action="store_true", help="Act as the AUTOMATIC1111/Forge install hook (the "
                        "default when the WebUI runs this file).")
    parser.add_argument("--requirements", type=Path, default=None, help="Pins to install (default "
                        "requirements.txt, or requirements-dev.txt with --dev).")
    parser.add_argument("--base-python", default=sys.executable, help="WebUI mode: the Python whose packages "
                        "the engine venv reuses and that creates it (default: this one, the WebUI's).")
    args = parser.parse_args(argv)  # before in_webui(): A1111's launch module appends its flags to sys.argv
    requirements_file = args.requirements or ROOT / ("requirements-dev.txt" if args.dev else "requirements.txt")
    if args.webui or in_webui():
        return webui_install(requirements_file, args.base_python, args.dry_run)

    if sys.prefix == sys.base_prefix:
        print("StableTune install: note: this Python is not a virtual environment; consider "
              "`python -m venv .venv` first so StableTune's pins do not touch other projects.")
    todo = missing(read_requirements(requirements_file))
    if todo and args.dry_run:
        say(f"would pip install {' '.join(todo)}")
        return 0
    test_venvs = start_webui_test_venvs() if args.dev and not args.dry_run else []
    if todo:
        pip_install(todo)
    if not finish_webui_test_venvs(test_venvs):
        return 1
    print("StableTune install: everything is in place.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
