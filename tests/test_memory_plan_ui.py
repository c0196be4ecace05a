"""Issue 36 items 3 and 6, the UI half: the Model tab shows the memory plan the run would make, in the sentence the
engine prints (computed by the engine through query_cli: the UI never imports torch), and what each memory choice
costs, for FLUX.2 Klein and SDXL; nothing for a family without a memory model."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from stabletune_core.config import build_config

ROOT = Path(__file__).resolve().parent.parent


def ask_memory(values: dict) -> dict:
    done = subprocess.run([sys.executable, "-m", "stabletune_core.query_cli", "memory"], input=json.dumps(values),
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_plan_text_is_the_engines_sentence_then_the_costs():
    from extension.validation import plan_text

    plan = "Memory plan for 6 GiB: chose base int8. Estimated GPU memory for SDXL: about 5.5 GiB (...)."
    costs = "What each choice needs (GiB at the peak, the rest as above): base_storage full 7.7 · int8 (now) 5.5."
    assert plan_text({"plan": plan, "memory": "Estimated ...", "gib": 7.7, "costs": costs}) == f"🧮 {plan}\n\n{costs}"
    cpu = plan_text({"plan": None, "memory": "Estimated GPU memory for SDXL: about 7.7 GiB.", "gib": 7.7,
                     "costs": costs})  # no vram_gb, no GPU to measure: the estimate, and what a plan would need
    assert cpu.startswith("🧮 Estimated GPU memory for SDXL: about 7.7 GiB. No memory plan on this machine")
    assert "set vram_gb" in cpu and cpu.endswith(costs)
    unknown = "No GPU-memory estimate: folder is not a released FLUX.2 Klein 4B or 9B that could be read."
    assert plan_text({"plan": None, "memory": unknown, "gib": None, "costs": None}) == f"🧮 {unknown}"
    assert plan_text({}) == "" and plan_text({"memory": None, "gib": None, "plan": None, "costs": None}) == ""


def test_the_engine_answers_the_sdxl_plan_in_the_runs_words_and_each_choices_cost():
    """The form sends every knob; those at their default are left to the plan, as in the run's config.toml."""
    from stabletune_core.models.memory_plan import plan_memory

    form = build_config(dict(model_family="sdxl", resolution=1024, mixed_precision="fp16", vram_gb=6))
    values = {k: v for k, v in form.model_dump(mode="json").items() if v is not None}  # every knob, as the UI
    answer = ask_memory(values)
    run = build_config(dict(model_family="sdxl", resolution=1024, mixed_precision="fp16", vram_gb=6))
    assert answer["plan"] == plan_memory(run, family="sdxl").sentence  # what the run prints, word for word
    assert answer["plan"].startswith("Memory plan for 6 GiB: chose text embeddings cached, gradient checkpointing, "
                                     "base int8.")
    storage = dict(re.findall(r"(full|int8|nf4|fp8)(?: \(now\))? (\d+\.\d)", answer["costs"].split(";")[0]))
    assert float(storage["full"]) > 6 > float(storage["int8"]) > float(storage["nf4"]), answer["costs"]
    assert f"int8 (now) {answer['plan'].split('about ')[1][:3]}" in answer["costs"]  # the plan's own number
    assert "gradient_checkpointing on (now) 5.5 · off" in answer["costs"] and "blocks_to_swap" not in answer["costs"]
    refused = ask_memory({**values, "vram_gb": 2})
    assert refused["plan"].startswith("vram_gb 2 is below anything this run fits in")
    assert ask_memory({"model_family": "sd1"}) == {"memory": None, "gib": None, "plan": None, "costs": None}


def test_the_model_tab_shows_the_plan_and_follows_each_memory_choice(tmp_path):
    from extension.settings import UISettings
    from extension.tabs import model as model_tab
    from extension.ui import build_ui
    from test_ui_parts import raw_form

    blocks = build_ui(UISettings(runs_dir=tmp_path / "runs", user_presets_dir=tmp_path / "presets"))
    ui = blocks.stabletune_context
    shown = model_tab._plan(ui, *raw_form(ui, model_family="sdxl", resolution=1024, mixed_precision="fp16",
                                          vram_gb=6))
    assert shown.startswith("🧮 Memory plan for 6 GiB: chose text embeddings cached, gradient checkpointing, base "
                            "int8.") and "base_storage full " in shown
    nf4 = model_tab._plan(ui, *raw_form(ui, model_family="sdxl", resolution=1024, mixed_precision="fp16", vram_gb=6,
                                        base_storage="nf4"))
    assert "chose text embeddings cached, gradient checkpointing." in nf4 and "nf4 (now)" in nf4
    assert model_tab._plan(ui, *raw_form(ui, model_family="sd1")) == ""
    # the line is redrawn when the model or a memory choice changes (the browser's own events, from its config)
    config = blocks.get_config_file()
    redraws = {target[0] for dep in config["dependencies"] if ui.parts["model.plan"]._id in dep["outputs"]
               for target in dep["targets"]}
    assert {ui.form.components[name]._id for name in ("pretrained_model_name_or_path", "model_family", "vram_gb",
                                                      "base_storage", "blocks_to_swap")} <= redraws


def test_the_uis_planned_families_are_the_plans_own():
    """The UI asks the engine for a plan only for the families the plan covers, and set-up measures the card only for
    them: the torch-free list (family_files), the plan's memory models and the families' own declaration agree."""
    from stabletune_core.family_files import PLANNED_FAMILIES
    from stabletune_core.models import FAMILIES
    from stabletune_core.models.memory_plan import FAMILY_MEMORY_MODELS

    assert set(PLANNED_FAMILIES) == set(FAMILY_MEMORY_MODELS)
    assert {name for name, make in FAMILIES.items() if make().plans_memory} == set(PLANNED_FAMILIES)
