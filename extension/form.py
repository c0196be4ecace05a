"""The config form, generated from the field schema: one component per field, values in and out.

Components are created where the tabs want them (the dataset folder sits in the Dataset tab, the run
folder in the Train tab, the rest in the Model tab's group accordions); `Form` keeps them in one ordered
registry so every event can take "the whole config" as its inputs.
"""
from __future__ import annotations

import math
import re
from typing import Any, Iterable

import gradio as gr

from .compat import GRADIO_VERSION, make, update

# Shown for an optional choice left empty ("use the model's own").
UNSET = "(default)"
ERROR_CLASS = "stabletune-field-error"  # red frame and text (style.css)
WARNING_CLASS = "stabletune-field-warning"  # amber: valid, but probably not what was meant

# Fields whose values come in multiples (stabletune_core.config refuses a resolution that is not a multiple of 8), and floats
# whose useful steps are finer than their default's magnitude suggests (a decay of 0.999 moves by 0.001).
STEP_OVERRIDES = {"resolution": 8, "bucket_step": 8, "min_bucket_reso": 8, "max_bucket_reso": 8,
                  "ema_decay": 0.001, "adam_beta1": 0.01, "adam_beta2": 0.001}


def step_for(field: dict[str, Any]) -> float:
    """The step of a number field's arrows: one decade below its default (a learning rate of 1e-4 moves by 1e-5,
    a weight of 1.0 by 0.1); a float that defaults to 0 moves by a hundredth of its range's decade."""
    if field["name"] in STEP_OVERRIDES:
        return STEP_OVERRIDES[field["name"]]
    if field["type"] == "int":
        return 1
    default, high = field.get("default"), field.get("max")
    if isinstance(default, (int, float)) and default:
        return float(f"1e{math.floor(math.log10(abs(default))) - 1}")
    if isinstance(high, (int, float)) and high > 0:
        return float(f"1e{math.floor(math.log10(high)) - 2}")
    return 0.01


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
            component = make(gr.Number, precision=0 if kind == "int" else None, step=step_for(field), **common)
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
            field = self.fields[name]
            try:
                values[name] = self.parse(field, value)
            except ValueError:
                problems.append(f"{name} is {value!r}: enter a {'whole ' if field['type'] == 'int' else ''}number.")
                continue
            if values[name] is None and field["type"] in ("int", "float") and not field["optional"]:
                # A number box the browser could not read (letters typed into it) arrives empty.
                problems.append(f"{name} is empty: enter a {'whole ' if field['type'] == 'int' else ''}number.")
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
        """The problem in the form's words: the field it starts with named by its label ("Learning rate is empty:
        enter a number."), other settings it mentions by theirs, and pydantic's phrases as advice."""
        name = field_of(problem, self.names)
        if name and problem.startswith(name):
            problem = self.fields[name]["label"] + problem[len(name):]
        for pattern, advice in _PLAIN_WORDS:
            problem = pattern.sub(advice, problem)
        return _SNAKE_NAME.sub(lambda m: self.mid_label(m.group(0)), problem)

    def mid_label(self, name: str) -> str:
        """A setting named inside a sentence: its label, lower case unless it starts with a name (LoRA, VAE)."""
        if name not in self.fields:
            return name
        label = self.fields[name]["label"]
        first = label.split(" ", 1)[0]
        return label if first[1:].lower() != first[1:] or first.isupper() else label[0].lower() + label[1:]

    def problem_fields(self, problems: list[str]) -> dict[str, list[str]]:
        by_field: dict[str, list[str]] = {}
        for problem in problems:
            name = field_of(problem, self.names)
            if name:
                by_field.setdefault(name, []).append(self.labelled(problem))
        return by_field

    def problem_updates(self, problems: list[str], warnings: list[str] = ()) -> list[Any]:
        """Each problem next to its field, shown as an error (red frame and text, ⚠); each warning as a warning
        (amber, it does not block); other fields get their doc back.

        Problems start with the field name (stabletune_core.config's contract); the first matching name wins.
        """
        by_field = self.problem_fields(problems)
        warned = self.problem_fields(warnings)
        styled = GRADIO_VERSION >= (4, 0)  # Gradio 3.41 cannot restyle a component by update

        def one(name: str) -> Any:
            if name in by_field:
                info, classes = "⚠ " + " ".join(by_field[name]), [ERROR_CLASS]
            elif name in warned:
                info, classes = "⚠ " + " ".join(warned[name]), [WARNING_CLASS]
            else:
                info, classes = self.info.get(name) or info_text(self.fields[name]), []
            return update(info=info, **({"elem_classes": classes} if styled else {}))

        return [one(n) for n in self.names]


# pydantic's own words (what stabletune_core.config passes on for a value it has no sentence of its own for) -> advice.
_PLAIN_WORDS = [
    (re.compile(r" is None: Input should be a valid (number|integer)[^.]*\."),
     lambda m: " is empty: enter a " + ("whole number." if m.group(1) == "integer" else "number.")),
    (re.compile(r" is None: Input should be a valid [^.]*\."), lambda m: " is empty: fill it in."),
    (re.compile(r": Input should be a valid number[^.]*\."), lambda m: ": enter a number."),
    (re.compile(r": Input should be a valid integer[^.]*\."), lambda m: ": enter a whole number."),
    (re.compile(r": Input should be a valid boolean[^.]*\."), lambda m: ": tick or untick it."),
    (re.compile(r": Input should be a valid string[^.]*\."), lambda m: ": enter text."),
    (re.compile(r": Input should be a valid list[^.]*\."), lambda m: ": enter values separated by commas."),
]
# A setting's name inside a sentence (snake_case, never a flag: "--resume auto" stays as typed).
_SNAKE_NAME = re.compile(r"(?<![-\w/.])[a-z][a-z0-9]*(?:_[a-z0-9]+)+(?![\w/])")


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
