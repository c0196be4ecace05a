"""A TrainConfig to and from its outside forms: TOML files (presets, RUN/config.toml) and plain values with the
field aliases diffusers' and kohya's scripts use, with pydantic's errors turned into one sentence each.

`TrainConfig` is the schema (schema.py, every knob) with its TOML form as methods, so a config saves and loads
itself (`config.save_toml(path)`, `TrainConfig.from_toml(path)`)."""
from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import ValidationError

from ..atomic import write_text_atomic
from .schema import ConfigError, TrainConfigSchema


class TrainConfig(TrainConfigSchema):
    def to_toml(self, *, leave_out: tuple[str, ...] = ()) -> str:
        return tomli_w.dumps({k: v for k, v in self.model_dump().items() if v is not None and k not in leave_out})

    def save_toml(self, path: Path | str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, self.to_toml())

    def save_form_toml(self, path: Path | str) -> None:
        """A config from the UI's form, which sends every knob: the knobs the memory plan chooses (PLAN_KNOBS) are
        left out where they hold their default, so the engine reading the file back counts them as not set by the
        user and vram_gb may choose them (written, every knob counted as set and the UI's runs got no plan). The
        same config (a missing knob is its default); one chosen at its default value counts as left to the plan.
        The engine rewrites the file whole, every knob, once the run is resolved."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, self.to_toml(leave_out=self.left_to_the_plan()))

    def left_to_the_plan(self) -> tuple[str, ...]:
        """The knobs the memory plan chooses (PLAN_KNOBS) that hold their default: what a config from the UI's form
        leaves to the plan (save_form_toml; query_cli's memory answer plans the same)."""
        from .families import PLAN_KNOBS

        return tuple(n for n in PLAN_KNOBS if getattr(self, n) == type(self).model_fields[n].default)

    @classmethod
    def from_toml(cls, path: Path | str, **overrides: Any) -> "TrainConfig":
        return build_config({**read_toml(path), **overrides})


def read_toml(path: Path | str) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"Config file {path} does not exist; check the path."])
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"Config file {path} is not valid TOML ({exc}); fix the line it names."]) from exc
    except UnicodeDecodeError:
        raise ConfigError([f"Config file {path} is not UTF-8 text; give a TOML config file."]) from None
    return resolve_aliases(data)


# ---- validation messages -------------------------------------------------------------------------------
def _sentence(error: dict[str, Any]) -> str:
    field = ".".join(str(p) for p in error["loc"]) or "config"
    value = error.get("input")
    kind = error["type"]
    ctx = error.get("ctx") or {}
    if kind == "extra_forbidden":
        return f"{field} is not a StableTune setting; check the spelling (python -m stabletune_core train --help)."
    if kind == "greater_than_equal":
        return f"{field} is {value!r} but must be at least {ctx['ge']}."
    if kind == "greater_than":
        return f"{field} is {value!r} but must be greater than {ctx['gt']}."
    if isinstance(value, float) and value != value:
        return f"{field} is not a number (NaN); give a number."
    if kind == "less_than_equal":
        return f"{field} is {value!r} but must be at most {ctx['le']}."
    if kind == "less_than":
        return f"{field} is {value!r} but must be less than {ctx['lt']}."
    if kind == "literal_error":
        return f"{field} is {value!r}; choose one of {ctx.get('expected')}."
    if kind == "value_error":
        message = str(ctx.get("error", error["msg"]))
        return f"{message}." if field == "config" else f"{field}: {message}."
    return f"{field} is {value!r}: {error['msg']}."


def build_config(values: dict[str, Any]) -> TrainConfig:
    """TrainConfig from plain values, with pydantic's errors turned into one sentence each."""
    try:
        return TrainConfig(**resolve_aliases(values))
    except ValidationError as exc:
        raise ConfigError([_sentence(e) for e in exc.errors()]) from None


def resolve_aliases(values: dict[str, Any]) -> dict[str, Any]:
    names = alias_table()
    return {names.get(k.replace("-", "_"), k.replace("-", "_")): v for k, v in values.items()}


def alias_table() -> dict[str, str]:
    table = {}
    for name, info in TrainConfigSchema.model_fields.items():
        for alias in (info.json_schema_extra or {}).get("aliases", []):
            table[alias] = name
    return table
