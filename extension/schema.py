"""The config fields as plain dicts: what the form is generated from.

With pydantic 2 installed the schema is read from TrainConfig itself; inside AUTOMATIC1111 (pydantic 1)
it comes from `config_schema.json`, which `write_schema()` regenerates and a test keeps up to date.
Each field: name, label, type (bool|int|float|str|choice|list), optional, default, description, group,
choices, min, max (with min_exclusive/max_exclusive), ui, aliases.
"""
from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

SCHEMA_FILE = Path(__file__).resolve().parent / "config_schema.json"

# Words that a plain "replace underscores" label would get wrong.
_LABEL_WORDS = {"lr": "LR", "lora": "LoRA", "snr": "SNR", "ddim": "DDIM", "tf32": "TF32", "reso": "resolution",
                "unet": "UNet", "adam": "Adam", "vae": "VAE", "8bit": "8-bit", "nan": "NaN", "oom": "OOM",
                "dir": "folder", "num": "number of"}


def label_for(name: str) -> str:
    words = [_LABEL_WORDS.get(w, w) for w in name.split("_")]
    first = words[0]
    return " ".join([first[:1].upper() + first[1:], *words[1:]])


def _limits(metadata: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in metadata:
        for attr, key, exclusive in (("ge", "min", False), ("gt", "min", True), ("le", "max", False),
                                     ("lt", "max", True)):
            value = getattr(item, attr, None)
            if value is not None:
                out[key] = value
                out[f"{key}_exclusive"] = exclusive
    return out


def _kind(annotation: Any) -> tuple[str, bool, list[Any] | None]:
    """(type name, optional, choices) of a field annotation."""
    args = typing.get_args(annotation)
    optional = type(None) in args
    if optional:
        annotation = next(a for a in args if a is not type(None))
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "choice", optional, list(typing.get_args(annotation))
    if origin is list:
        return "list", optional, None
    names = {bool: "bool", int: "int", float: "float", str: "str"}
    return names.get(annotation, "str"), optional, None


def schema_from_config() -> list[dict[str, Any]]:
    """Read the fields from TrainConfig (needs pydantic 2; never imports torch)."""
    from stabletune_core.config import TrainConfig

    fields = []
    for name, info in TrainConfig.model_fields.items():
        extra = dict(info.json_schema_extra or {})
        kind, optional, choices = _kind(info.annotation)
        fields.append({
            "name": name, "label": label_for(name), "type": kind, "optional": optional, "default": info.default,
            "description": info.description or "", "group": extra.get("group", "other"), "choices": choices,
            **_limits(info.metadata), "ui": bool(extra.get("ui", True)),
            "aliases": list(extra.get("aliases", [])),
        })
    return fields


def groups_from_config() -> list[str]:
    from stabletune_core.config import GROUPS

    return list(GROUPS)


def write_schema(path: Path = SCHEMA_FILE) -> None:
    """Regenerate config_schema.json (run after changing TrainConfig: `python -m extension.schema`)."""
    data = {"groups": groups_from_config(), "fields": schema_from_config()}
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def load_schema() -> tuple[list[str], list[dict[str, Any]]]:
    """(groups, fields): from TrainConfig when it imports here, else from the committed JSON."""
    try:
        return groups_from_config(), schema_from_config()
    except ImportError:  # pydantic 1 host (A1111), or tomli_w missing
        data = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
        return data["groups"], data["fields"]


if __name__ == "__main__":
    write_schema()
    print(f"wrote {SCHEMA_FILE}")
