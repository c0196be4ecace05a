"""Start the engine as its own process, and ask it short questions.

The UI never trains in its own process (DESIGN.md): a crash, an OOM kill or a NaN in the trainer cannot
take the UI down, and the UI can restart and re-attach by reading the run directory. Commands are argv
lists, never shell strings, so no path or value is ever interpreted by a shell.

This module imports neither torch nor gradio, and not pydantic at import time: the A1111 host (pydantic 1)
imports it too and falls back to asking the engine's own Python to validate and write the config.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .runs.layout import RunPaths

try:  # Python 3.11+; the A1111 host may be 3.10 and have tomli instead
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - depends on the host
    import tomli as tomllib  # type: ignore[no-redef]


class LaunchError(RuntimeError):
    """The engine could not be started; `problems` holds one sentence each."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def engine_env() -> dict[str, str]:
    """The child's environment: unbuffered output so train.log is live, and this checkout importable."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def train_command(config_toml: Path, engine_python: str = sys.executable, num_processes: int = 1) -> list[str]:
    """The argv that trains the run described by `config_toml`; accelerate spreads it over N devices."""
    tail = ["-m", "stabletune_core", "train", "--config", str(config_toml)]
    if num_processes > 1:
        # --multi_gpu: one process per device through torchrun, whatever a stale default accelerate config says;
        # --quiet: a failed run's log ends with the engine's sentence, not the launcher's traceback under it
        return [engine_python, "-m", "accelerate.commands.launch", "--num_processes", str(num_processes),
                "--multi_gpu", "--quiet", *tail]
    return [engine_python, *tail]


def ask_engine(command: list[str], engine_python: str = sys.executable, *, stdin: Any = None,
               timeout: float = 600) -> dict[str, Any]:
    """Run `python -m stabletune_core.query_cli COMMAND...` and return its JSON answer.

    A failure of the child itself (missing package, crash) becomes {"error": sentence} with the last line
    of its stderr, so callers have a single shape to handle.
    """
    argv = [engine_python, "-m", "stabletune_core.query_cli", *command]
    try:
        done = subprocess.run(argv, input=None if stdin is None else json.dumps(stdin), capture_output=True,
                              text=True, timeout=timeout, env=engine_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"The engine ({engine_python}) could not answer: {exc}."}
    lines = done.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"The engine ({engine_python}) failed: {last}"}


def write_run_config(config: Any, engine_python: str = sys.executable) -> Path:
    """Validate `config` (a TrainConfig, a dict of values or a TOML path) and write RUN/config.toml (values: only
    the knobs that differ from the defaults, TrainConfig.save_form_toml).

    In-process when this interpreter has pydantic 2 (the standalone app), otherwise through the engine's
    Python. Returns the run directory; raises LaunchError with the problems.
    """
    if hasattr(config, "save_toml"):
        paths = RunPaths(Path(config.output_dir).expanduser())
        config.save_toml(paths.config)
        return paths.root
    values = _read_values(config)
    try:
        built = checked_config(values)
    except ImportError:
        return _write_via_engine(values, engine_python)
    paths = RunPaths(Path(built.output_dir).expanduser())
    built.save_form_toml(paths.config)  # the form sends every knob: only the changed ones count as set (vram_gb)
    return paths.root


def checked_config(values: Mapping[str, Any]) -> Any:
    """The TrainConfig for `values`, checked against the files it names; LaunchError lists every problem.
    Raises ImportError on a host without the engine's pydantic 2 (callers then ask the engine's Python)."""
    from .config import ConfigError, build_config, check_inputs

    try:
        built = build_config(dict(values))
    except ConfigError as exc:
        raise LaunchError(exc.problems) from None
    problems = check_inputs(built)
    if problems:
        raise LaunchError(problems)
    return built


def _read_values(config: Mapping[str, Any] | Path | str) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    with open(config, "rb") as f:
        return tomllib.load(f)


def _write_via_engine(values: dict[str, Any], engine_python: str) -> Path:
    output_dir = Path(str(values.get("output_dir") or values.get("run_dir") or "./lora_output")).expanduser()
    paths = RunPaths(output_dir)
    answer = ask_engine(["validate", "--write", str(paths.config)], engine_python, stdin=values)
    if "error" in answer:
        raise LaunchError([answer["error"]])
    if answer.get("problems"):
        raise LaunchError(answer["problems"])
    return paths.root


def spawn(run_dir: Path, engine_python: str = sys.executable, num_processes: int = 1) -> subprocess.Popen:
    """Start training RUN/config.toml in a new session (the UI dying does not kill it); output -> train.log."""
    paths = RunPaths(Path(run_dir))
    if not paths.config.is_file():
        raise LaunchError([f"{paths.config} does not exist; write the run's config before starting it."])
    with open(paths.log, "ab") as log:
        return subprocess.Popen(train_command(paths.config, engine_python, num_processes), stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, env=engine_env(),
                                start_new_session=True)
