"""Command-line flags generated from the TrainConfig fields (`python -m stabletune_core train --help`)."""
from __future__ import annotations

import argparse
from typing import Any, Literal

from .files import TrainConfig, build_config, read_toml


# ---- CLI flags generated from the fields ---------------------------------------------------------------
def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per field (`--name` and `--name-with-dashes` plus aliases); defaults stay unset so that
    only flags the user typed override a config file."""
    parser.add_argument("--config", help="TOML file (a preset or a saved config.toml) to start from.")
    for name, info in TrainConfig.model_fields.items():
        extra = info.json_schema_extra or {}
        flags = _flag_names(name, extra.get("aliases", []))
        # argparse formats help with %: a doc saying "90 %" would break --help
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS,
                                  "help": (info.description or "").replace("%", "%%")}
        annotation = info.annotation
        origin = getattr(annotation, "__origin__", None)
        args = getattr(annotation, "__args__", ())
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif origin is list:
            kwargs["nargs"] = "+"
        else:
            base = _base_type(annotation)
            if base in (int, float):
                kwargs["type"] = base
            if getattr(base, "__origin__", None) is Literal or (origin is Literal):
                kwargs["choices"] = list((base if getattr(base, "__origin__", None) is Literal else annotation).__args__)
            elif args and type(None) in args:
                kwargs["metavar"] = name.upper()
        parser.add_argument(*flags, **kwargs)


def _flag_names(name: str, aliases: list[str]) -> list[str]:
    flags = []
    for n in [name, *aliases]:
        for spelled in (f"--{n}", f"--{n.replace('_', '-')}"):
            if spelled not in flags:
                flags.append(spelled)
    return flags


def _base_type(annotation: Any) -> Any:
    args = [a for a in getattr(annotation, "__args__", ()) if a is not type(None)]
    if getattr(annotation, "__origin__", None) is Literal:
        return annotation
    if len(args) == 1 and type(None) in getattr(annotation, "__args__", ()):
        return args[0]
    return annotation


def config_from_args(namespace: argparse.Namespace) -> TrainConfig:
    values = vars(namespace).copy()
    base = read_toml(values.pop("config")) if values.get("config") else {}
    values.pop("config", None)
    fields = TrainConfig.model_fields
    return build_config({**base, **{k: v for k, v in values.items() if k in fields}})
