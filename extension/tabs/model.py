"""Model & hyperparameters tab: base model source, presets, and every config field grouped by topic."""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import gradio as gr

from .. import models, presets
from ..compat import listen, make, unchanged, update
from ..context import UIContext
from ..form import field_of
from ..validation import is_klein_model, memory_answer, memory_estimate, plan_text, transformer_family, validate
from stabletune_core.family_files import KLEIN, TRANSFORMER_FAMILIES
from stabletune_core.launch import ask_engine

TITLE = "Model & hyperparameters"
# Fields laid out by other tabs (they belong to a task there, not to the generic form).
PLACED = ("train_data_dir", "output_dir", "pretrained_model_name_or_path")
# Values a preset never carries: they describe this machine, not a recipe.
MACHINE_FIELDS = (*PLACED, "resume_from_checkpoint", "model_config_dir")
GROUP_TITLES = {"model": "Model", "data": "Data & captions", "lora": "LoRA", "optimization": "Optimization",
                "precision": "Precision & memory", "guards": "Guards (NaN, OOM, clipping)",
                "validation": "Validation images", "diagnostics": "Diagnostics", "output": "Checkpoints & output"}
OPEN_GROUPS = ("lora", "optimization")
# The form's own grouping where the engine's (stabletune_core/config) groups by implementation: the loss regularisers
# sit together, after Optimization.
GROUP_TITLES["regularisation"] = "Regularisation (noise offset, min-SNR, perceptual loss)"
REGULARISERS = ("noise_offset", "snr_gamma", "perceptual_")


def ui_group(name: str, group: str) -> str:
    return "regularisation" if name.startswith(REGULARISERS) else group


def form_groups(ctx: UIContext) -> list[tuple[str, list[str]]]:
    """(group, field names) in the order the accordions appear."""
    order = list(ctx.groups)
    order.insert(order.index("optimization") + 1 if "optimization" in order else len(order), "regularisation")
    fields = {g: [] for g in order}
    for group in ctx.groups:
        for name in ctx.form.ui_fields(group, PLACED):
            fields[ui_group(name, group)].append(name)
    return [(g, names) for g, names in fields.items() if names]


def build(ctx: UIContext) -> None:
    p, settings = ctx.parts, ctx.settings
    with make(gr.Row, equal_height=False):
        with make(gr.Column, scale=2):
            gr.Markdown("### Preset")
            with gr.Row():
                p["model.preset"] = make(gr.Dropdown, label="Preset", choices=presets.list_all(settings.preset_folders),
                                         value=None, elem_id="preset-choice", scale=3)
                p["model.load"] = make(gr.Button, value="Load preset", elem_id="preset-load", scale=1)
            with gr.Row():
                p["model.preset_name"] = make(gr.Textbox, label="Save current settings as", placeholder="my-preset",
                                              scale=3)
                p["model.save"] = make(gr.Button, value="Save preset", scale=1)
            p["model.preset_message"] = make(gr.Markdown, value="", elem_id="preset-message")
        with make(gr.Column, scale=3):
            gr.Markdown("### Base model")
            p["model.source"] = make(gr.Radio, label="Source", choices=list(models.SOURCES), value=models.SOURCES[0])
            found = models.find_models(models.SOURCES[0], settings.model_dirs)
            p["model.found"] = make(gr.Dropdown, label="Found in the model folders (or type the path below)",
                                    choices=found, value=None, info=models.found_info(found, settings.model_dirs),
                                    elem_id="model-found")
            ctx.form.build(["pretrained_model_name_or_path"])
            p["model.plan"] = make(gr.Markdown, value="", elem_id="memory-plan")
    for group, names in form_groups(ctx):
        if names:
            with make(gr.Accordion, label=GROUP_TITLES.get(group, group.title()), open=group in OPEN_GROUPS,
                      elem_id=f"group-{group}") as accordion:
                p[f"model.group.{group}"] = accordion
                _grid(ctx, names)
    with gr.Row():
        p["model.check"] = make(gr.Button, value="Check settings", elem_id="check-settings")
    p["model.problems"] = make(gr.Markdown, value="", elem_id="settings-problems")


def _grid(ctx: UIContext, names: list[str], per_row: int = 3) -> None:
    for start in range(0, len(names), per_row):
        with gr.Row():
            ctx.form.build(names[start:start + per_row])


def problems_text(problems: list[str], notes: list[str], form: Any = None, *, started: bool = False,
                  memory: str = "") -> str:
    """Problems block the start; notes (valid, probably not meant) are warnings: the run starts anyway. `memory`:
    the engine's GPU-memory estimate (FLUX.2 Klein), shown with valid settings."""
    words = form.labelled if form else (lambda p: p)
    if problems:
        text = "**Fix these before starting:**\n\n" + "\n".join(f"- ⚠ {words(p)}" for p in problems)
    else:
        text = "" if started else "✅ Settings are valid."
        if memory:
            text += ("\n\n" if text else "") + f"🧮 {memory}"
    if notes:
        text += ("\n\n" if text else "") + "**Check these (they do not stop a run):**\n\n" + "\n".join(
            f"- ⚠ {words(n)}" for n in notes)
    return text


def check(ctx: UIContext, raw: tuple[Any, ...]) -> tuple[dict[str, Any], list[str], list[str]]:
    """(values, problems, notes) of the form as it stands."""
    values, unreadable = ctx.form.values(raw)
    if unreadable:  # still check the rest (the unreadable fields at their defaults): every problem at once
        bad = {field_of(p, ctx.form.names) for p in unreadable}
        problems, notes = validate({k: v for k, v in values.items() if k not in bad}, ctx.settings.engine_python)
        return values, unreadable + [p for p in problems if field_of(p, ctx.form.names) not in bad], notes
    problems, notes = validate(values, ctx.settings.engine_python)
    return values, problems, notes


def _check(ctx: UIContext, *raw: Any) -> list[Any]:
    values, problems, notes = check(ctx, raw)
    memory = "" if problems else memory_estimate(values, ctx.settings.engine_python)
    return [problems_text(problems, notes, ctx.form, memory=memory), *ctx.form.problem_updates(problems, notes),
            *group_marks(ctx, problems)]


#: The fields whose change changes the memory plan shown under the base model (FLUX.2 Klein and SDXL).
PLAN_FIELDS = ("pretrained_model_name_or_path", "model_family", "vram_gb", "base_storage", "blocks_to_swap",
               "gradient_checkpointing", "cache_text_embeddings", "mixed_precision", "resolution", "train_batch_size",
               "gradient_accumulation_steps", "lora_rank", "unet_lora_targets", "train_text_encoder")
_PLAN_SHOWN: dict[str, str] = {}  # the form's values (JSON) -> its plan text: one preset load fires many changes
_PLAN_LOCK = threading.Lock()


def _plan(ctx: UIContext, *raw: Any) -> str:
    """The memory plan the run would make with the form as it stands, and what each memory choice costs (the engine
    answers: the UI never imports torch); empty for the families without a memory model or an unreadable form."""
    values, unreadable = ctx.form.values(raw)
    if unreadable:
        return ""
    key = json.dumps(values, sort_keys=True, default=str)
    with _PLAN_LOCK:  # the changes of one edit ask once; the others wait and read the answer
        if key not in _PLAN_SHOWN:
            if len(_PLAN_SHOWN) > 64:
                _PLAN_SHOWN.clear()
            _PLAN_SHOWN[key] = plan_text(memory_answer(values, ctx.settings.engine_python))
        return _PLAN_SHOWN[key]


def group_marks(ctx: UIContext, problems: list[str]) -> list[Any]:
    """Each accordion with a bad field opens and says so in its title; the others get their title back."""
    bad = set(ctx.form.problem_fields(problems))
    marks = []
    for group, names in form_groups(ctx):
        title = GROUP_TITLES.get(group, group.title())
        if bad & set(names):
            marks.append(update(label=f"⚠ {title}: fix the fields marked ⚠", open=True))
        else:
            marks.append(update(label=title))
    return marks


def _load(ctx: UIContext, name: str | None, *raw: Any) -> list[Any]:
    if not name:
        return ["Choose a preset first.", *ctx.form.updates({})]
    current, _ = ctx.form.values(raw)
    values = {**ctx.form.defaults(), **{k: current[k] for k in MACHINE_FIELDS if k in current}}
    values.update(presets.load_preset(presets.folder_of(ctx.settings.preset_folders, name), name, ctx.aliases()))
    message = f"Loaded preset **{name}**."
    if name in presets.DEMO_PRESETS:
        family, concept = presets.DEMO_PRESETS[name]
        answer = ask_engine(["demo-assets", "--family", family, "--concept", concept], ctx.settings.engine_python,
                            timeout=1800)
        if "error" in answer:
            return [f"⚠ The demo model could not be built: {answer['error']}", *ctx.form.updates({})]
        values.update(answer, output_dir=str(ctx.settings.runs_dir / name))
        message += " The toy model and its dataset are filled in: click **Start** in Train."
    elif family_changed(values, current):
        values["pretrained_model_name_or_path"] = ""
        message += (f" The base model was cleared: {Path(str(current['pretrained_model_name_or_path'])).name} is not "
                    f"a {FAMILY_WORDS.get(values['model_family'], values['model_family'])} model, which this preset "
                    "trains; choose one under Base model.")
    unknown = sorted(set(values) - set(ctx.form.names))
    if unknown:
        message += f" Not in this version's form (ignored): {', '.join(unknown)}."
    return [message, *ctx.form.updates({k: v for k, v in values.items() if k in ctx.form.components})]


FAMILY_WORDS = {**{family: words.name for family, words in TRANSFORMER_FAMILIES.items()},
                "sd1": "Stable Diffusion 1.x", "sd2": "Stable Diffusion 2.x", "sdxl": "SDXL"}


def family_changed(preset_values: dict[str, Any], current: dict[str, Any]) -> bool:
    """The preset trains another family than the form's model is (Klein, Z-Image or a Stable Diffusion one), and
    names no model of its own: the form's model would make a run that fails."""
    family = preset_values.get("model_family") or "auto"
    path = str(current.get("pretrained_model_name_or_path") or "").strip()
    if family == "auto" or not path or preset_values.get("pretrained_model_name_or_path") != path:
        return False
    found = transformer_family({"pretrained_model_name_or_path": path}) or (
        KLEIN if is_klein_model(path) else None)  # a Klein hub name counts too
    return found != (family if family in TRANSFORMER_FAMILIES else None)


def _save(ctx: UIContext, name: str, *raw: Any) -> list[Any]:
    problem = presets.preset_name_problem(name)
    if problem:
        return [f"⚠ {problem}", update()]
    values, problems = ctx.form.values(raw)
    if problems:
        return ["⚠ " + " ".join(problems), update()]
    recipe = {k: v for k, v in ctx.form.non_default(values).items() if k not in MACHINE_FIELDS}
    path = presets.save_preset(ctx.settings.user_presets_dir, name, recipe, comment="Saved from the StableTune UI.")
    return [f"Saved preset **{name}** ({len(recipe)} settings) to {path}.",
            update(choices=presets.list_all(ctx.settings.preset_folders), value=name)]


def _found(source: str, choice: str | None) -> Any:
    return update(value=choice) if choice else update()


def _source(ctx: UIContext, source: str) -> Any:
    found = models.find_models(source, ctx.settings.model_dirs)
    return update(choices=found, value=None, info=models.found_info(found, ctx.settings.model_dirs, source))


def source_for_path(path: str | None, source: str | None) -> Any:
    """The Source radio follows the model path (a preset or a typed path): a folder is a diffusers folder."""
    guessed = models.guess_source(str(path or "").strip()) if path else None
    return update(value=guessed) if guessed and guessed != source else update()


def wire(ctx: UIContext) -> None:
    p, form = ctx.parts, ctx.form
    model_path = form.components["pretrained_model_name_or_path"]
    listen(p["model.load"].click, lambda name, *raw: _load(ctx, name, *raw), [p["model.preset"], *form.inputs],
           [p["model.preset_message"], *form.inputs])
    listen(p["model.save"].click, lambda name, *raw: _save(ctx, name, *raw), [p["model.preset_name"], *form.inputs],
           [p["model.preset_message"], p["model.preset"]])
    listen(p["model.source"].change, lambda source: _source(ctx, source), [p["model.source"]], [p["model.found"]])
    listen(p["model.found"].change, _found, [p["model.source"], p["model.found"]], [model_path])
    listen(model_path.change, source_for_path, [model_path, p["model.source"]], [p["model.source"]])
    for name in PLAN_FIELDS:  # the plan follows the model and each memory choice, before Start
        if name in form.components:
            listen(form.components[name].change, lambda *raw: _plan(ctx, *raw), form.inputs, [p["model.plan"]])
    listen(p["model.check"].click, lambda *raw: _check(ctx, *raw), form.inputs,
           [p["model.problems"], *form.inputs, *accordions(ctx)])
    # "Try the demo" at the top of the page: the demo preset into the form, then the Train tab opens.
    def try_demo(*raw: Any) -> Any:  # a generator function itself: Gradio streams only those (not a lambda's)
        yield from _try_demo(ctx, *raw)

    demo = listen(p["demo.try"].click, try_demo, form.inputs, [p["demo.message"], p["model.preset"], *form.inputs])
    listen(demo.then, None, None, None, js=OPEN_TRAIN_JS, _js=OPEN_TRAIN_JS)


# Clicks the Train tab (a server-side Tabs update snaps Gradio 6 back to the first tab; see persist.TAB_JS). Gradio 6
# also renders a hidden copy of each tab button (its overflow menu), which comes first and does nothing when
# clicked: the tab button that is laid out is the one to click (Gradio 3.41 has only that one).
OPEN_TRAIN_JS = """() => {
  const app = document.querySelector('gradio-app');
  const root = app && app.shadowRoot ? app.shadowRoot : document;
  const tabs = root.querySelector('#stabletune-tabs');
  const named = tabs ? [...tabs.querySelectorAll('button')].filter(b => b.textContent.trim() === 'Train') : [];
  const train = named.find(b => b.getClientRects().length > 0 && b.getAttribute('role') === 'tab')
             || named.find(b => b.getClientRects().length > 0) || named[0];
  if (train) train.click();
  return [];
}"""
DEMO_BUILDING = ("⏳ **Building the demo** (the first time only, about a minute on a CPU): the toy model is written "
                 "out, then it draws its own images of the colours it knows beside 12 drawn purple shapes for the "
                 "dataset. The form fills in and the Train tab opens when it is done.")


def _try_demo(ctx: UIContext, *raw: Any) -> Any:
    """The demo preset into the form; first a line saying what is being built (the first click builds the toy
    model and its dataset, about a minute behind a bare spinner otherwise)."""
    yield [DEMO_BUILDING, update(), *(unchanged() for _ in ctx.form.inputs)]
    message, *fields = _load(ctx, presets.DEMO_PRESET, *raw)
    if message.startswith("⚠"):
        yield [message, update(), *fields]
        return
    yield ["✅ The demo is filled in (the toy model and its drawn shapes). Click **Start training** below; the "
           "Monitor and Samples tabs show it learn purple.", update(value=presets.DEMO_PRESET), *fields]


def accordions(ctx: UIContext) -> list[Any]:
    return [ctx.parts[f"model.group.{g}"] for g, _ in form_groups(ctx)]
