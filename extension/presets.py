"""Presets: partial configs in TOML files (presets/*.toml), listed, loaded and saved by name."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

try:  # Python 3.11+; A1111 hosts may run 3.10 with tomli
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - depends on the host
    import tomli as tomllib  # type: ignore[no-redef]

# The demo presets name no model or dataset: the engine builds them (the family's toy base, drawn shapes and the
# base's own images), as `python -m stabletune_core demo --family F --concept C` does (demo.demo_preset).
DEMO_PRESET = "demo"
DEMO_PRESETS = {DEMO_PRESET: ("sd1", "colour"), "demo-shape": ("sd1", "shape"),
                "demo-flux2-klein": ("flux2_klein", "colour"), "demo-z_image": ("z_image", "colour")}


def list_presets(folder: Path) -> list[str]:
    return sorted(p.stem for p in Path(folder).glob("*.toml"))


def list_all(folders: list[Path]) -> list[str]:
    """Preset names across folders (the user's and the shipped ones); a user preset may shadow a shipped one."""
    return sorted({name for folder in folders for name in list_presets(folder)})


def folder_of(folders: list[Path], name: str) -> Path:
    """The first folder (the user's comes first) that holds preset `name`."""
    return next((Path(f) for f in folders if (Path(f) / f"{name}.toml").is_file()), Path(folders[-1]))


def load_preset(folder: Path, name: str, aliases: dict[str, str]) -> dict[str, Any]:
    """The preset's values with alias keys (lr, rank, ...) turned into field names."""
    with open(Path(folder) / f"{name}.toml", "rb") as f:
        data = tomllib.load(f)
    return {aliases.get(k.replace("-", "_"), k.replace("-", "_")): v for k, v in data.items()}


def preset_name_problem(name: str) -> str | None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name or ""):
        return "Preset name must be letters, digits, '.', '-' or '_' (for example my-style-12gb)."
    return None


def save_preset(folder: Path, name: str, values: dict[str, Any], comment: str = "") -> Path:
    path = Path(folder) / f"{name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    header = "".join(f"# {line}\n" for line in comment.splitlines())
    path.write_text(header + dumps_flat_toml(values), encoding="utf-8")
    return path


def dumps_flat_toml(values: dict[str, Any]) -> str:
    """TOML for a flat table of str/int/float/bool/list values (all a preset holds); None is left out.

    JSON string escapes are valid TOML basic strings, which keeps this tiny and dependency-free.
    """
    return "".join(f"{key} = {_toml_value(value)}\n" for key, value in values.items() if value is not None)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{value} cannot be stored in a preset")
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)
