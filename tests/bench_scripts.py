"""The scripts under bench/ as modules, for the tests that check their command lines and tables without the peer."""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_bench(name: str) -> ModuleType:
    """bench/<name>.py, imported as the module `name` (its siblings importable, as when it runs as a script)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def parsed_by_stabletune(command: list[str]):
    """The TrainConfig `python -m stabletune_core train ...` would run with these arguments."""
    from stabletune_core.config.flags import add_config_arguments, config_from_args

    assert command[:3] == ["-m", "stabletune_core", "train"]
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(command[3:]))
