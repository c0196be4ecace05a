"""Issue 23 item 7 (brief item 5): FLUX.2 Klein in the UI: the family in the picker, the 4B-at-12-GB and 9B-at-24-GB
presets, and the engine's memory estimate shown when the settings are checked (before Start)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flux2_tools import tiny_klein_paths
from stabletune_core.config import build_config, read_toml
from stabletune_core.models.flux2_klein.family import SHIPPED_CONFIGS
from test_ui_parts import raw_form, ui  # noqa: F401  (the whole UI built in-process, as the UI tests use it)

ROOT = Path(__file__).resolve().parent.parent
KLEIN_PRESETS = sorted((ROOT / "presets").glob("flux2-klein-*gb.toml"))


def test_klein_presets_are_valid_and_their_estimate_fits_the_card_they_name():
    from stabletune_core.models.flux2_klein.memory import config_memory_sentence

    # the next smaller card each must not fit (issue 36 added the 8, 12 and 16 GB ones: int8, swap)
    smaller = {"flux2-klein-4b-8gb": 6, "flux2-klein-4b-12gb": 8, "flux2-klein-9b-12gb": 8, "flux2-klein-9b-16gb": 12,
               "flux2-klein-9b-24gb": 16}
    assert [p.stem for p in KLEIN_PRESETS] == sorted(smaller)
    for preset in KLEIN_PRESETS:
        variant, gigabytes = re.match(r"flux2-klein-(\d+b)-(\d+)gb", preset.stem).groups()
        config = build_config({**read_toml(preset), "pretrained_model_name_or_path": str(SHIPPED_CONFIGS[variant])})
        assert config.model_family == "flux2_klein"
        sentence, estimate = config_memory_sentence(config)
        assert f"FLUX.2 Klein {variant.upper()}:" in sentence and estimate.fits(int(gigabytes)), sentence
        assert not estimate.fits(smaller[preset.stem])  # the card size in the name is the one that matters
        assert f"{estimate.total_gib:.1f} GiB" in preset.read_text()  # the preset's comment says the same number


def test_engine_memory_answer_is_for_klein_only(tmp_path_factory):
    paths = tiny_klein_paths(tmp_path_factory)

    def ask(values: dict) -> dict:
        done = subprocess.run([sys.executable, "-m", "stabletune_core.query_cli", "memory"], input=json.dumps(values),
                              capture_output=True, text=True, cwd=ROOT, timeout=300)
        return json.loads(done.stdout.strip().splitlines()[-1])

    klein = ask({"pretrained_model_name_or_path": str(paths["folder"])})  # auto: detected from the folder
    assert klein["memory"].startswith("No GPU-memory estimate: folder is not a released") and klein["gib"] is None
    assert ask({"model_family": "sd1"}) == {"memory": None, "gib": None, "plan": None, "costs": None}


def test_family_picker_offers_klein_and_check_settings_shows_the_estimate(ui, tmp_path_factory,  # noqa: F811
                                                                          shapes_dataset):
    from extension import presets
    from extension.tabs import model as model_tab

    assert "flux2_klein" in ui.form.fields["model_family"]["choices"]
    assert {"flux2-klein-4b-12gb", "flux2-klein-9b-24gb"} <= set(presets.list_all(ui.settings.preset_folders))
    paths = tiny_klein_paths(tmp_path_factory)
    out = tmp_path_factory.mktemp("ui-klein") / "run"
    raw = raw_form(ui, model_family="flux2_klein", pretrained_model_name_or_path=str(paths["folder"]),
                   train_data_dir=str(shapes_dataset), output_dir=str(out))
    message = model_tab._check(ui, *raw)[0]
    # The tiny Klein is not a released size: no 4B-guess number (issue 37.7), a sentence saying why.
    assert "Settings are valid" in message and "🧮 No GPU-memory estimate: folder is not a released FLUX.2 Klein" \
        in message, message
    sd = raw_form(ui, model_family="sd1", pretrained_model_name_or_path=str(paths["folder"]),
                  train_data_dir=str(shapes_dataset), output_dir=str(out), weighting_scheme="cosmap")
    assert "belongs to FLUX.2 Klein (its flow-matching objective)" in model_tab._check(ui, *sd)[0]


def test_check_settings_judges_the_knobs_of_a_detected_klein(ui, tmp_path_factory, shapes_dataset):  # noqa: F811
    """model_family auto with a Klein folder: Check settings lists what the engine would refuse at Start."""
    from extension.tabs import model as model_tab

    paths = tiny_klein_paths(tmp_path_factory)
    raw = raw_form(ui, pretrained_model_name_or_path=str(paths["folder"]), train_data_dir=str(shapes_dataset),
                   output_dir=str(tmp_path_factory.mktemp("ui-auto") / "run"), snr_gamma=5.0)
    message = model_tab._check(ui, *raw)[0]
    assert "Fix these before starting" in message and "weights DDPM timesteps" in message, message


def test_the_engine_validate_answer_judges_a_detected_klein_too(tmp_path_factory, shapes_dataset):
    """The same through `query_cli validate` (AUTOMATIC1111's Python cannot build the config itself)."""
    paths = tiny_klein_paths(tmp_path_factory)
    values = {"pretrained_model_name_or_path": str(paths["folder"]), "train_data_dir": str(shapes_dataset),
              "output_dir": str(tmp_path_factory.mktemp("engine-auto") / "run"), "snr_gamma": 5.0}
    done = subprocess.run([sys.executable, "-m", "stabletune_core.query_cli", "validate"], input=json.dumps(values),
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    problems = json.loads(done.stdout.strip().splitlines()[-1])["problems"]
    assert len(problems) == 1 and problems[0].startswith("snr_gamma is set to 5.0")
