"""The config form, generated from the field schema: one component per field, values in and out.

Components are created where the tabs want them (the dataset folder sits in the Dataset tab, the run
folder in the Train tab, the rest in the Model tab's group accordions); `Form` keeps them in one ordered
registry so every event can take "the whole config" as its inputs.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import gradio as gr

from .compat import GRADIO_VERSION, make, update

# Shown for an optional choice left empty ("use the model's own").
UNSET = "(default)"
ERROR_CLASS = "stabletune-field-error"  # red frame and text (compat.TICK_CSS / style.css)


def range_text(field: dict[str, Any]) -> str:
    """'1 <= value <= 1024' style hint from the field's limits."""
    low, high = field.get("min"), field.get("max")
    if low is None and high is None:
        return ""
    parts = []
    if low is not None:
        parts.append(f"{low} {'<' if field.get('min_exclusive') else '≤'} ")
    parts.append("value")
    if high is not None:
        parts.append(f" {'<' if field.get('max_exclusive') else '≤'} {high}")
    return "".join(parts)


def info_text(field: dict[str, Any]) -> str:
    """The tooltip under a field: its doc and its range."""
    text = field["description"]
    limits = range_text(field)
    if limits:
        text += f" ({limits})"
    return text


def display_value(field: dict[str, Any], value: Any) -> Any:
    """A config value as its component shows it."""
    kind = field["type"]
    if kind == "list":
        return ", ".join(value or [])
    if kind == "choice":
        return UNSET if value is None else value
    if kind == "bool":
        return bool(value)
    if field["optional"] or kind == "str":
        return "" if value is None else str(value)
    return value


class Form:
    def __init__(self, fields: list[dict[str, Any]]):
        self.fields = {f["name"]: f for f in fields}
        self.components: dict[str, Any] = {}
        self.info: dict[str, str] = {}  # each component's own info line (a tab may override the field doc)

    # ---- building ------------------------------------------------------------------------------------
    def build(self, names: Iterable[str], **overrides: Any) -> list[Any]:
        """Create the components of `names` in the current layout context."""
        return [self._component(self.fields[n], **overrides) for n in names]

    def _component(self, field: dict[str, Any], **overrides: Any) -> Any:
        common = dict(label=field["label"], info=info_text(field), elem_id=f"field-{field['name']}",
                      value=display_value(field, field["default"]))
        common.update(overrides)
        self.info[field["name"]] = common["info"]
        kind = field["type"]
        if kind == "bool":
            component = make(gr.Checkbox, **common)
        elif kind == "choice":
            choices = ([UNSET] if field["optional"] else []) + list(field["choices"])
            component = make(gr.Dropdown, choices=choices, **common)
        elif kind in ("int", "float") and not field["optional"]:
            component = make(gr.Number, precision=0 if kind == "int" else None, **common)
        else:  # text, lists and optional numbers: a textbox, where empty means "not set"
            component = make(gr.Textbox, lines=1, **common)
        self.components[field["name"]] = component
        return component

    def ui_fields(self, group: str, placed: Iterable[str]) -> list[str]:
        """Names of a group's fields that belong in the generic form (not hidden, not placed elsewhere)."""
        skip = set(placed)
        return [n for n, f in self.fields.items() if f["group"] == group and f["ui"] and n not in skip]

    # ---- values --------------------------------------------------------------------------------------
    @property
    def inputs(self) -> list[Any]:
        return list(self.components.values())

    @property
    def names(self) -> list[str]:
        return list(self.components)

    def values(self, raw: Iterable[Any]) -> tuple[dict[str, Any], list[str]]:
        """Typed config values from the components' raw values, and one sentence per unparseable one."""
        values, problems = {}, []
        for name, value in zip(self.names, raw):
            try:
                values[name] = self.parse(self.fields[name], value)
            except ValueError:
                problems.append(f"{name} is {value!r} but must be a number.")
        return values, problems

    @staticmethod
    def parse(field: dict[str, Any], value: Any) -> Any:
        kind = field["type"]
        if kind == "bool":
            return bool(value)
        if kind == "list":
            return [part.strip() for part in str(value or "").replace("\n", ",").split(",") if part.strip()]
        if kind == "choice":
            return None if value in (UNSET, None, "") else value
        if value is None or (isinstance(value, str) and not value.strip()):
            return None if field["optional"] else ("" if kind == "str" else None)
        if kind == "int":
            number = float(value)
            return int(number) if number == int(number) else number  # 1.5 stays 1.5 so validation names it
        if kind == "float":
            number = float(value)
            return number if math.isfinite(number) else value
        return str(value)

    def updates(self, values: dict[str, Any]) -> list[Any]:
        """One update per component: the given values shown, the others left as they are."""
        return [update(value=display_value(self.fields[n], values[n])) if n in values else update()
                for n in self.names]

    def defaults(self) -> dict[str, Any]:
        return {n: self.fields[n]["default"] for n in self.names}

    def non_default(self, values: dict[str, Any]) -> dict[str, Any]:
        """What a preset stores: only the values that differ from the defaults."""
        return {n: v for n, v in values.items() if v != self.fields[n]["default"] and v is not None}

    def labelled(self, problem: str) -> str:
        """The problem as the form shows it: the field named by its label, e.g. "LoRA rank (lora_rank) is 0"."""
        name = field_of(problem, self.names)
        if name and problem.startswith(name):
            return f"{self.fields[name]['label']} ({name}){problem[len(name):]}"
        return problem

    def problem_fields(self, problems: list[str]) -> dict[str, list[str]]:
        by_field: dict[str, list[str]] = {}
        for problem in problems:
            name = field_of(problem, self.names)
            if name:
                by_field.setdefault(name, []).append(self.labelled(problem))
        return by_field

    def problem_updates(self, problems: list[str]) -> list[Any]:
        """Each problem next to its field, shown as an error (red frame, ⚠); other fields get their doc back.

        Problems start with the field name (config.py's contract); the first matching name wins.
        """
        by_field = self.problem_fields(problems)
        styled = GRADIO_VERSION >= (4, 0)  # Gradio 3.41 cannot restyle a component by update

        def one(name: str) -> Any:
            bad = name in by_field
            info = "⚠ " + " ".join(by_field[name]) if bad else self.info.get(name) or info_text(self.fields[name])
            return update(info=info, **({"elem_classes": [ERROR_CLASS] if bad else []} if styled else {}))

        return [one(n) for n in self.names]


# check_inputs() speaks of the world ("Dataset folder X does not exist"), not of field names.
_WORLD_WORDS = (("Dataset", "train_data_dir"), ("Model", "pretrained_model_name_or_path"),
                ("Output path", "output_dir"), ("Cannot write", "output_dir"), ("Only ", "output_dir"))


def field_of(problem: str, names: Iterable[str]) -> str | None:
    """The field a problem sentence is about: the longest field name it starts with, the field its
    opening words describe, or the first field name it mentions."""
    names = sorted(names, key=len, reverse=True)
    for name in names:
        if problem.startswith(name):
            return name
    for words, name in _WORLD_WORDS:
        if problem.startswith(words) and name in names:
            return name
    for name in names:
        if name in problem:
            return name
    return None
