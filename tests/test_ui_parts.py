"""The UI's pieces without a browser: schema, form values, validation placement, presets, plots, samples,
diagnostics, status line, the launcher and app.py's flags."""
from __future__ import annotations

import json
import math
import os
import socket
import stat
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from PIL import Image

import app
from extension import dataset_view, diagnostics, plots, presets, samples
from extension.form import UNSET, Form, field_of
from extension.schema import SCHEMA_FILE, label_for, load_schema, schema_from_config
from extension.session import RunHub
from extension.status import speed, status_line
from extension.validation import validate
from stabletune_core.config import TrainConfig, build_config
from stabletune_core.launch import LaunchError, spawn, train_command, write_run_config
from stabletune_core.runs.layout import RunPaths
from stabletune_core.runs.reader import RunReader
from stabletune_core.runs.writer import RunWriter

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ROOT / "presets"


@pytest.fixture(scope="module")
def form() -> Form:
    _, fields = load_schema()
    form = Form(fields)
    form.components = {f["name"]: None for f in fields}  # the value logic needs names, not widgets
    return form


# ---- schema and form --------------------------------------------------------------------------------------
def test_committed_schema_is_up_to_date() -> None:
    committed = json.loads(SCHEMA_FILE.read_text())["fields"]
    assert committed == json.loads(json.dumps(schema_from_config())), \
        "extension/config_schema.json is stale: run `python -m extension.schema`"


def test_schema_covers_every_field_with_docs_and_limits() -> None:
    fields = {f["name"]: f for f in schema_from_config()}
    assert set(fields) == set(TrainConfig.model_fields)
    assert all(f["description"] for f in fields.values())
    assert fields["lora_rank"]["min"] == 1 and fields["lora_rank"]["max"] == 1024
    assert fields["lora_dropout"]["max_exclusive"] is True
    assert fields["lr_scheduler"]["type"] == "choice" and "cosine" in fields["lr_scheduler"]["choices"]
    assert fields["max_train_steps"]["optional"] and fields["max_train_steps"]["type"] == "int"
    assert fields["unet_lora_targets"]["type"] == "list"
    assert fields["use_8bit_adam"]["ui"] is False
    assert label_for("lr_warmup_steps") == "LR warmup steps"
    assert label_for("train_data_dir") == "Train data folder"


def test_form_parses_what_widgets_return(form: Form) -> None:
    raw = {n: form.fields[n]["default"] for n in form.names}
    raw.update(max_train_steps="60", lora_alpha="", unet_lora_targets="to_q, to_k\nto_v", prediction_type=UNSET,
               learning_rate=0.001, lora_rank=8.0, validation_prompt="", resolution=64)
    values, problems = form.values([raw[n] for n in form.names])
    assert problems == []
    assert values["max_train_steps"] == 60 and values["lora_alpha"] is None
    assert values["unet_lora_targets"] == ["to_q", "to_k", "to_v"]
    assert values["prediction_type"] is None and values["validation_prompt"] is None
    assert values["lora_rank"] == 8 and isinstance(values["lora_rank"], int)
    values, problems = form.values([{"max_train_steps": "sixty"}.get(n, raw[n]) for n in form.names])
    assert problems == ["max_train_steps is 'sixty': enter a whole number."]


def test_problems_land_next_to_their_field(form: Form) -> None:
    try:
        build_config({"lora_rank": 0, "resolution": 100, "lr_scheduler": "wobbly"})
    except Exception as exc:  # ConfigError
        problems = exc.problems
    assert {field_of(p, form.names) for p in problems} == {"lora_rank", "resolution", "lr_scheduler"}
    assert field_of("Dataset folder /x does not exist; choose ...", form.names) == "train_data_dir"
    assert field_of("min_bucket_reso (512) is larger than max_bucket_reso (256); swap them.", form.names) \
        == "min_bucket_reso"
    updates = form.problem_updates(["lora_rank is 0 but must be at least 1."])
    by_name = dict(zip(form.names, updates))
    assert by_name["lora_rank"]["info"].startswith("⚠ LoRA rank is 0")
    assert not by_name["seed"]["info"].startswith("⚠")


def test_validate_reports_values_and_world(tmp_path: Path) -> None:
    problems, _ = validate({"lora_rank": 0}, sys.executable)
    assert any(p.startswith("lora_rank") for p in problems)
    problems, _ = validate({"train_data_dir": str(tmp_path / "nope"), "pretrained_model_name_or_path": "",
                            "output_dir": str(tmp_path / "run")}, sys.executable)
    assert any("does not exist" in p for p in problems) and any("pretrained_model" in p for p in problems)


# ---- presets ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", presets.list_presets(PRESETS))
def test_every_shipped_preset_is_a_valid_partial_config(name: str, form: Form) -> None:
    values = presets.load_preset(PRESETS, name, {})
    assert set(values) <= set(form.names), f"{name} names unknown fields"
    build_config(values)


def test_shipped_presets_include_the_issue_list() -> None:
    assert {"demo", "sd15-character-8gb", "sd15-style-12gb", "v2.3-recommended"} <= set(presets.list_presets(PRESETS))


def test_preset_round_trip_and_names(tmp_path: Path) -> None:
    values = {"learning_rate": 1e-4, "lora_rank": 16, "gradient_checkpointing": True,
              "validation_prompt": 'a "quoted" prompt | ünïcode', "unet_lora_targets": ["to_q", "to_k"]}
    path = presets.save_preset(tmp_path, "mine", values, comment="two\nlines")
    assert tomllib.loads(path.read_text()) == values
    assert presets.load_preset(tmp_path, "mine", {"lr": "learning_rate"}) == values
    (tmp_path / "alias.toml").write_text("lr = 0.5\nrank = 4\n")
    assert presets.load_preset(tmp_path, "alias", {"lr": "learning_rate", "rank": "lora_rank"}) == \
        {"learning_rate": 0.5, "lora_rank": 4}
    assert presets.preset_name_problem("../evil") and presets.preset_name_problem("")
    assert presets.preset_name_problem("my-style_2.0") is None


# ---- plots, samples, diagnostics, status ------------------------------------------------------------------
def test_metrics_frames_for_the_plots() -> None:
    metrics = [{"step": s, "loss": 1.0 / s, "lr": 1e-3, "grad_norm": 0.5, "clip_threshold": 1.0, "ram_mb": 900}
               for s in range(1, 51)]
    metrics[10]["loss"] = "nan"
    frame = plots.metrics_frame(metrics)
    assert len(frame) == 50 and frame["loss"].isna().sum() == 1
    assert frame["loss_ema"].notna().all()  # one NaN step does not break the smoothed line
    loss = plots.plot_frame(frame, "loss")
    assert set(loss["series"]) == {"loss", "loss (EMA)"} and list(loss.columns) == ["step", "value", "series"]
    assert set(plots.plot_frame(frame, "grad")["series"]) == {"grad norm", "clip threshold"}
    assert set(plots.plot_frame(frame, "memory")["series"]) == {"RAM"}  # CPU run: no VRAM columns
    assert plots.plot_frame(plots.metrics_frame([]), "loss").empty
    assert "50 logged steps" in plots.summary(frame)
    long = plots.metrics_frame([{"step": s, "loss": 1.0} for s in range(5000)])
    thinned = plots.thin(long)
    assert len(thinned) <= plots.MAX_POINTS + 1 and thinned["step"].iloc[-1] == 4999
    events = plots.events_frame([{"step": 1, "kind": "a", "message": "x"}, {"step": None, "kind": "b", "message": "y"}])
    assert list(events["kind"]) == ["b", "a"]


def test_plot_updates_never_send_empty_frames_or_a_changed_series_set() -> None:
    """Issue 12.1: a LinePlot keeps the axes and colours of the first frame it drew, so an empty frame, an
    Inf, or a series that appears later would leave it blank or incomplete."""
    early = plots.metrics_frame([{"step": s, "grad_norm": 0.5, "clip_threshold": "nan"} for s in range(1, 4)])
    late = plots.metrics_frame([{"step": s, "grad_norm": "inf" if s == 5 else 0.5, "clip_threshold": 1.0}
                                for s in range(1, 8)])
    grad = plots.plot_frame(late, "grad")
    assert grad["value"].map(math.isfinite).all() and 5 not in set(grad[grad["series"] == "grad norm"]["step"])
    assert plots.plot_update(plots.plot_frame(plots.metrics_frame([]), "grad"), None) == (None, ())
    value, drawn = plots.plot_update(plots.plot_frame(early, "grad"), ())
    assert drawn == ("grad norm",) and len(value) == 3
    value, drawn = plots.plot_update(grad, drawn)  # the clip threshold appears: clear first ...
    assert value is None and drawn == ()
    value, drawn = plots.plot_update(grad, drawn)  # ... then the plot is rebuilt with both series
    assert drawn == ("clip threshold", "grad norm") and set(value["series"]) == set(drawn)


def test_sample_gallery_lines_up_prompts_and_seeds(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    for step in (40, 80):
        folder = paths.sample_dir(step)
        folder.mkdir(parents=True)
        (folder / "prompts.json").write_text(json.dumps({"prompts": ["a red circle", "a blue square"],
                                                         "seeds": [42, 43]}))
        for name in ("p00_s42", "p00_s43", "p01_s42", "p01_s43"):
            Image.new("RGB", (8, 8)).save(folder / f"{name}.png")
    reader = RunReader(tmp_path)
    page = samples.grid_html(reader, samples.ALL, lambda p: f"/f/{p.parent.name}/{p.name}")
    rows = page.split("<tr>")[1:]
    # Issue 12.8/25.8: newest step first, one row per step, a column per prompt x seed headed by its whole prompt.
    assert [r.count("<img") for r in rows] == [0, 4, 4]
    assert [label for label in ("a red circle · seed 42", "a red circle · seed 43", "a blue square · seed 42",
                                "a blue square · seed 43") if f"<th>{label}</th>" in rows[0]] == [
        "a red circle · seed 42", "a red circle · seed 43", "a blue square · seed 42", "a blue square · seed 43"]
    assert "step 80" in rows[1] and "/f/step_000080/p00_s42.png" in rows[1] and "step 40" in rows[2]
    assert 'title="step 80 · a red circle · seed 42"' in rows[1]
    choices = samples.choices(reader)
    assert choices[0] == samples.ALL and "p01_s43: a blue square · seed 43" in choices
    one = samples.grid_html(reader, choices[1], lambda p: f"/f/{p.parent.name}/{p.name}")
    assert one.count("<img") == 2 and one.index("step_000080/p00_s42") < one.index("step_000040/p00_s42")
    assert "<caption>a red circle · seed 42</caption>" in one


def test_sample_gallery_shows_the_judges_measures_in_degrees_beside_each_step(tmp_path: Path) -> None:
    """Issue 21.1: the Samples tab speaks of learning as the engine measured it (the sample judge's `sample_score`
    events: hue error and drift in degrees, shapes), on the row of the step it measured."""
    paths = RunPaths(tmp_path)
    for step in (0, 100):
        folder = paths.sample_dir(step)
        folder.mkdir(parents=True)
        (folder / "prompts.json").write_text(json.dumps({"prompts": ["a purple circle"], "seeds": [7]}))
        Image.new("RGB", (8, 8)).save(folder / "p00_s7.png")
    reader = RunReader(tmp_path)
    before = samples.signature(reader)
    writer = RunWriter(tmp_path)
    line = "purple: 4 deg off; kept: red drift 1 deg; shapes 92 %"
    writer.event("sample_score", f"Validation images at step 100: {line}.", step=100, line=line,
                 measures={"concept": {"purple": 4.0}, "drift": {"red": 1.0}, "shapes": 0.92, "images": 1})
    assert samples.signature(reader) != before  # the measures land after the images: the gallery is sent again
    rows = samples.grid_html(reader, samples.ALL, lambda p: f"/f/{p.name}").split("<tr>")[1:]
    assert "step 100" in rows[1] and line in rows[1] and "deg" not in rows[2]
    assert "%" not in line.replace("shapes 92 %", "")  # no closed-set "purple 0 % -> 100 %" wording


def test_diagnostics_read_spectra_and_warnings(tmp_path: Path) -> None:
    writer = RunWriter(tmp_path)
    from stabletune_core.runs.jsonfiles import append_jsonl

    for step in (0, 50, 100):
        for module, spread in (("up.attn.to_q", 1.0), ("down.attn.to_k", 0.2)):
            values = [spread ** (i * step / 100) for i in range(8)]
            append_jsonl(writer.paths.diagnostics / "spectra.jsonl", {"step": step, "module": module,
                                                                       "singular_values": values})
    writer.event("collapse", "down.attn.to_k effective rank fell below 2.", step=100)  # runs/events.py's kind
    reader = RunReader(tmp_path)
    records = diagnostics.spectra(reader)
    assert diagnostics.modules(records) == ["down.attn.to_k", "up.attn.to_q"]
    assert diagnostics.effective_rank([1.0] * 8) == pytest.approx(8.0)
    assert diagnostics.effective_rank([1.0, 0.0]) == pytest.approx(1.0)
    assert diagnostics.heatmap(records, "up.attn.to_q") is not None
    assert diagnostics.heatmap(records, "missing") is None
    assert diagnostics.rank_lines(records) is not None
    assert diagnostics.warnings(reader)[0][1] == "collapse"
    assert diagnostics.available(reader) == ["spectra.jsonl"]


def test_diagnostics_tab_is_live_and_draws_every_module_activations_and_val_loss(ui) -> None:
    """Issue 12.4: no leftover "once the diagnostics work lands"; a run with one spectra step still draws;
    the effective rank shows every module (one heatmap row each, no legend); activation statistics and the
    validation loss with its best point and early-stopping triggers; redrawn by the live refresh only when
    something new was written."""
    from stabletune_core.runs.jsonfiles import append_jsonl
    from extension.tabs import diagnostics as diag_tab

    assert "lands" not in diag_tab.EMPTY
    writer = RunWriter(ui.settings.runs_dir / "diag-run")
    writer.status("stopped", step=20)
    folder = writer.paths.diagnostics
    names = [f"unet.up_blocks.{b}.attentions.0.transformer_blocks.0.attn1.to_{q}" for b in range(3) for q in "qkv"]
    for name in names:  # one spectra step only
        append_jsonl(folder / "spectra.jsonl", {"step": 10, "module": name, "singular_values": [3.0, 1.0, 0.1]})
        append_jsonl(folder / "activations.jsonl", {"step": 10, "module": name, "mean": 0.1, "var": 2.0,
                                                    "zero_fraction": 0.0})
    for step, value in ((5, 0.5), (10, 0.4), (15, 0.45), (20, 0.47)):
        append_jsonl(folder / "val_loss.jsonl", {"step": step, "val_loss": value})
    writer.event("early_stopping_trigger", "Validation loss rose.", step=15)
    seen = {"run": writer.paths.root}
    info, module, spectrum, rank, activations, val, warnings, *_ = diag_tab.refresh(ui, seen, None, "var")
    assert "9 modules" in info and module["value"] == sorted(names)[0]
    assert spectrum is not None and rank is not None and activations is not None
    rank_axes = rank.axes[0]
    assert len(rank_axes.get_yticklabels()) == 9 and rank_axes.get_legend() is None
    assert rank_axes.get_xlim()[1] > rank_axes.get_xlim()[0]  # one step: a real column, not a zero-width one
    val_axes = val.axes[0]
    labels = [t.get_text() for t in val_axes.get_legend().get_texts()]
    assert "best 0.4 (step 10)" in labels and "early-stopping trigger" in labels
    assert all(v == {"__type__": "update"} for v in diag_tab.refresh(ui, seen, None, "var"))  # nothing new
    for step in range(1, 21):
        writer.metric(step, loss=1.0 / step)
    from extension.tabs import monitor

    summary, loss, *_ = monitor.refresh(ui, {"run": writer.paths.root})
    assert set(loss["series"]) == {"loss", "loss (EMA)", "validation loss"}
    assert "best validation loss 0.4 at step 10" in summary


def low_rank_spectra(modules: int = 4, rank: int = 16) -> list[list[float]]:
    """Singular values of LoRAs that use ~5 of their `rank` directions: a steep head, a tiny tail."""
    return [[(2.0 + m) * 0.35 ** i if i < 5 else 1e-4 for i in range(rank)] for m in range(modules)]


def test_resize_offer_from_the_recorded_spectra_says_what_the_engine_says() -> None:
    """Issue 13.9: the Diagnostics tab's sentence comes from RUN/diagnostics/spectra.jsonl without torch, and
    it is the engine's `suggest_rank` sentence for the same numbers (newest step of each module)."""
    from extension import resize_offer
    from stabletune_core.lora.resize import suggest_rank
    from stabletune_core.lora.svd import Spectrum

    values = low_rank_spectra()
    records = [{"step": 10, "module": f"m{i}", "sv": [1.0] * 16, "effective_rank": 16.0} for i in range(4)]
    records += [{"step": 20, "module": f"m{i}", "sv": sv, "effective_rank": diagnostics.effective_rank(sv)}
                for i, sv in enumerate(values)]
    rank, sentence = resize_offer.suggest(records)
    engine = suggest_rank([Spectrum(f"m{i}", sv, [v / sv[0] for v in sv], diagnostics.effective_rank(sv), 1.0,
                                    1.0, 1.0) for i, sv in enumerate(values)])
    assert sentence == engine and rank == 4
    assert sentence.startswith("this LoRA uses ~") and "of its 16 ranks: resize to 4 keeps 99 %" in sentence
    flat = [{"step": 1, "module": "m", "sv": [1.0] * 16, "effective_rank": 16.0}]
    assert resize_offer.suggest(flat) is None  # every rank is used: nothing to offer


def tiny_kohya_lora(path: Path, rank: int = 16, true_rank: int = 3) -> Path:
    """A kohya-format LoRA file (two modules) whose updates have rank `true_rank`, written without torch."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {}
    for name, (out, inp) in {"lora_unet_a_to_q": (24, 32), "lora_unet_b_to_k": (32, 24)}.items():
        low = rng.standard_normal((out, true_rank)) @ rng.standard_normal((true_rank, rank))
        tensors[f"{name}.lora_up.weight"] = (0.1 * low).astype(np.float32)
        tensors[f"{name}.lora_down.weight"] = rng.standard_normal((rank, inp)).astype(np.float32)
        tensors[f"{name}.alpha"] = np.array(rank / 2, dtype=np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"ss_network_dim": str(rank)})
    return path


def test_diagnostics_tab_offers_resize_and_its_button_runs_the_engine(ui) -> None:
    """Issue 13.9: the live Diagnostics tab shows the offer and proposes the rank; the button runs
    `python -m stabletune_core resize LORA --rank N` as an argv list in the engine's Python, which writes
    LORA-rN.safetensors beside the LoRA and never overwrites (a second click says so)."""
    from safetensors import safe_open

    from extension import resize_offer
    from extension.tabs import diagnostics as diag_tab
    from stabletune_core.runs.jsonfiles import append_jsonl

    writer = RunWriter(ui.settings.runs_dir / "resize-run")
    writer.status("finished", step=20)
    for i, sv in enumerate(low_rank_spectra()):
        append_jsonl(writer.paths.diagnostics / "spectra.jsonl", {"step": 20, "module": f"m{i}", "singular_values": sv})
    lora = tiny_kohya_lora(writer.paths.output / "style.safetensors")
    *_, suggest, rank = diag_tab.refresh(ui, {"run": writer.paths.root}, None, "var")
    assert "this LoRA uses ~" in suggest and "resize to 4 keeps 99 %" in suggest
    assert "`style-r4.safetensors` beside `style.safetensors`" in suggest and rank["value"] == 4

    argv = resize_offer.resize_command("/engine/python", lora, 4)
    assert argv == ["/engine/python", "-m", "stabletune_core", "resize", str(lora), "--rank", "4"]
    message = diag_tab._resize(ui, "resize-run", 4)
    target = writer.paths.output / "style-r4.safetensors"
    assert message.startswith("Resized to rank 4") and str(target) in message, message
    with safe_open(str(target), "np") as f:
        assert f.get_tensor("lora_unet_a_to_q.lora_down.weight").shape == (4, 32)
    assert lora.exists()  # the original stays
    before = target.stat().st_mtime_ns
    again = diag_tab._resize(ui, "resize-run", 4)
    assert again.startswith("⚠ Resize failed") and "already exists" in again and target.stat().st_mtime_ns == before
    assert resize_offer.resize(sys.executable, None, 4).startswith("⚠ This run has no exported LoRA")


def test_status_line() -> None:
    line = status_line("demo", {"state": "training", "step": 40, "max_steps": 120, "sec_per_step": 0.25,
                                "eta_seconds": 20, "loss": 0.1234}, {"kind": "samples", "message": "Made 4 images."})
    assert "step 40/120" in line and "4.00 it/s" in line and "ETA 0:00:20" in line and "Made 4 images" in line
    assert speed(4.0) == "4.00 s/it" and speed(None) == "–"
    assert "ETA" not in status_line("x", {"state": "stopped", "eta_seconds": 5}, None)


# ---- launcher ---------------------------------------------------------------------------------------------
def test_train_command_is_an_argv_list(tmp_path: Path) -> None:
    config = tmp_path / "run dir; rm -rf ~" / "config.toml"
    assert train_command(config, "/py") == ["/py", "-m", "stabletune_core", "train", "--config", str(config)]
    assert train_command(config, "/py", 2)[:5] == ["/py", "-m", "accelerate.commands.launch", "--num_processes", "2"]


def fake_engine(tmp_path: Path, exit_code: int = 0) -> str:
    """A stand-in for the engine's Python that records its argv and session, then exits."""
    script = tmp_path / "fake-python"
    script.write_text(f'#!/bin/sh\necho "$@" > "{tmp_path}/argv.txt"\nps -o sid= -p $$ > "{tmp_path}/sid.txt"\n'
                      f'echo engine says hello\nexit {exit_code}\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_start_writes_config_then_spawns_in_its_own_session(tmp_path: Path, shapes_dir: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text("{}")  # the config check looks for a diffusers layout
    values = {"pretrained_model_name_or_path": str(model), "train_data_dir": str(shapes_dir),
              "output_dir": str(tmp_path / "run"), "max_train_steps": 5}
    run_dir = write_run_config(values)
    config = RunPaths(run_dir).config
    assert TrainConfig.from_toml(config).max_train_steps == 5
    process = spawn(run_dir, fake_engine(tmp_path))
    assert process.wait(10) == 0
    assert (tmp_path / "argv.txt").read_text().split() == ["-m", "stabletune_core", "train", "--config", str(config)]
    assert int((tmp_path / "sid.txt").read_text()) != os.getsid(0)  # survives the UI's terminal/session
    assert "engine says hello" in RunPaths(run_dir).log.read_text()


def test_start_refuses_bad_config(tmp_path: Path) -> None:
    with pytest.raises(LaunchError) as info:
        write_run_config({"lora_rank": 0, "output_dir": str(tmp_path / "run")})
    assert any(p.startswith("lora_rank") for p in info.value.problems)
    assert not (tmp_path / "run" / "config.toml").exists()


def test_hub_reports_launching_and_early_exit(tmp_path: Path) -> None:
    hub = RunHub(tmp_path)
    run = tmp_path / "run"
    RunPaths(run).root.mkdir()
    RunPaths(run).config.write_text("")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    hub.started(run, sleeper)
    assert hub.status()["state"] == "launching" and hub.is_live()
    sleeper.kill()
    sleeper.wait()
    status = hub.status()
    assert status["state"] == "failed" and status["exit_code"] != 0 and not hub.is_live()


def test_hub_reattaches_to_the_live_run(tmp_path: Path) -> None:
    old = RunWriter(tmp_path / "old")
    old.status("finished", step=10)
    time.sleep(0.01)
    RunWriter(tmp_path / "live").status("training", step=3)  # this process's pid: alive
    time.sleep(0.01)
    data = json.loads(RunPaths(tmp_path / "old").status.read_text())
    data["updated_at"] = time.time()
    RunPaths(tmp_path / "old").status.write_text(json.dumps(data))
    assert RunHub(tmp_path).attach_default() == tmp_path / "live"


@pytest.fixture(scope="module")
def ui(tmp_path_factory: pytest.TempPathFactory):
    """The whole UI built in this process (no browser): its context, for calling the tabs' handlers."""
    from extension.settings import UISettings
    from extension.ui import build_ui

    return build_ui(UISettings(runs_dir=tmp_path_factory.mktemp("ui-runs"),
                               user_presets_dir=tmp_path_factory.mktemp("user-presets"))).stabletune_context


def raw_form(ctx, **values) -> list:
    """What the browser sends for the whole form: the defaults as widgets show them, with `values`."""
    from extension.form import display_value

    shown = {n: display_value(f, f["default"]) for n, f in ctx.form.fields.items()}
    shown.update(values)
    return [shown[n] for n in ctx.form.names]


def test_start_refuses_a_dataset_without_usable_images(ui, tmp_path: Path) -> None:
    """Issue 12.2: Check settings and Start run the engine's dataset check; no run folder is made."""
    from extension.tabs import model as model_tab, train as train_tab

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("no images here")
    (tmp_path / "model_index.json").write_text("{}")  # the config check looks for a diffusers layout
    raw = raw_form(ui, train_data_dir=str(empty), pretrained_model_name_or_path=str(tmp_path),
                   output_dir=str(tmp_path / "run"))
    checked = model_tab._check(ui, *raw)[0]
    assert "holds no images" in checked and "valid" not in checked
    message = train_tab._start(ui, *raw)[0]
    assert message.startswith("**Fix these before starting:**") and f"Dataset folder {empty} holds no images" in message
    assert not (tmp_path / "run").exists() and ui.hub.attached is None


def test_train_buttons_progress_and_eta_follow_the_state(ui, tmp_path: Path) -> None:
    """Issue 12.7: no Pause while stopped, Continue only when paused, Resume only with a checkpoint; a real
    progress bar; no ETA once stopped."""
    from extension.tabs import train as train_tab

    run = ui.settings.runs_dir / "buttons"
    writer = RunWriter(run)
    writer.status("training", step=30, max_steps=120, eta_seconds=90, sec_per_step=0.5)  # this pid: alive
    ui.hub.attach(run)
    seen: dict = {}
    line, _, _, bar, *buttons = train_tab.refresh(ui, seen)
    enabled = dict(zip(train_tab.BUTTONS, (b["interactive"] for b in buttons)))
    assert enabled == {"start": False, "pause": True, "resume": False, "save": True, "sample": True,
                       "stop": True, "continue_run": False}
    assert 'aria-valuenow="30"' in bar and "width:25.0%" in bar and "ETA 0:01:30" in line
    assert all(b == {"__type__": "update"} for b in train_tab.refresh(ui, seen)[4:])  # unchanged: not resent
    writer.status("paused", step=30)
    assert [b["interactive"] for b in train_tab.refresh(ui, seen)[4:]] == [False, False, True, True, True, True, False]
    writer.status("stopped", step=31)
    (writer.paths.checkpoints / "step_000031").mkdir()
    (writer.paths.checkpoints / "step_000031" / "manifest.json").write_text("{}")
    line, _, _, bar, *buttons = train_tab.refresh(ui, seen)
    assert [b["interactive"] for b in buttons] == [True, False, False, False, False, False, True]
    assert "ETA" not in line and "stopped" in line
    ui.hub.attach(None)


def paused_timeline(run: Path, step_time: float = 0.5, pause: float = 600.0) -> float:
    """metrics.jsonl and events.jsonl of 60 steps at `step_time` s/step with a `pause` after step 50, as the
    engine writes them; returns the engine's own moving-average sec_per_step after step 60."""
    at, last, average = 1_000_000.0, 1_000_000.0, None
    metrics, events = [], []
    for step in range(1, 61):
        if step == 51:  # paused after step 50's metric, continued `pause` seconds later
            events.append({"time": at + 0.01, "step": 50, "kind": "pause", "message": "Paused at step 50."})
            at += 0.01 + pause
            events.append({"time": at, "step": 50, "kind": "unpaused", "message": "Continuing from step 50."})
        at += step_time
        average = at - last if average is None else 0.9 * average + 0.1 * (at - last)  # the loop's formula
        last = at
        metrics.append({"step": step, "time": at, "loss": 0.1})
    RunPaths(run).metrics.write_text("".join(json.dumps(m) + "\n" for m in metrics))
    RunPaths(run).events.write_text("".join(json.dumps(e) + "\n" for e in events))
    return average


def test_eta_after_a_pause_counts_training_time_only(ui) -> None:
    """Issue 12.7: right after a 10-minute pause the ETA is remaining steps x the true step time (the
    engine's wall-time average would say hours); a paused run shows no ETA."""
    import re

    from extension import eta
    from extension.tabs import train as train_tab

    run = ui.settings.runs_dir / "paused-eta"
    writer = RunWriter(run)
    engine_average = paused_timeline(run)
    assert engine_average > 20  # what status.json carries: the pause counted as step time
    writer.status("training", step=60, max_steps=1000, sec_per_step=engine_average,
                  eta_seconds=engine_average * 940)
    line = train_tab.refresh(ui, {"run": run})[0]
    hours, minutes, seconds = map(int, re.search(r"ETA (\d+):(\d\d):(\d\d)", line).groups())
    assert abs(hours * 3600 + minutes * 60 + seconds - 940 * 0.5) <= 5, line
    assert "2.00 it/s" in line
    writer.status("paused", step=60)
    assert "ETA" not in train_tab.refresh(ui, {"run": run})[0]
    # An interval across an engine restart (model loading) is not a step either.
    restarted = [{"step": 1, "time": 0.0}, {"step": 2, "time": 1.0}, {"step": 3, "time": 300.0},
                 {"step": 4, "time": 301.0}]
    assert eta.active_seconds_per_step(restarted, [{"time": 150.0, "kind": "resumed_from_checkpoint"}]) == 1.0
    writer.status("stopped", step=60)


def test_presets_saved_to_the_user_folder_model_hint_and_regularisers(ui, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 12.11: Save preset writes to the user's folder (not the repository's presets/), which the list
    and Load see; an empty model list says how to fill it; perceptual loss sits with the regularisers."""
    from extension import models
    from extension.tabs import model as model_tab

    shipped = sorted(p.name for p in PRESETS.iterdir())
    monkeypatch.setattr(ui.settings, "user_presets_dir", tmp_path / "mine")
    message, choices = model_tab._save(ui, "my-style", *raw_form(ui, learning_rate=3e-4))
    assert (tmp_path / "mine" / "my-style.toml").is_file() and str(tmp_path / "mine") in message
    assert sorted(p.name for p in PRESETS.iterdir()) == shipped
    assert "my-style" in choices["choices"] and "demo" in choices["choices"]
    loaded = model_tab._load(ui, "my-style", *raw_form(ui))
    assert loaded[0].startswith("Loaded preset **my-style**")
    assert dict(zip(ui.form.names, loaded[1:]))["learning_rate"]["value"] == 3e-4
    assert "--model-dir" in models.found_info([], [])
    assert "--model-dir" in models.found_info([], [tmp_path], "Diffusers folder")
    folder = tmp_path / "tiny-sd1"
    folder.mkdir()
    assert model_tab.source_for_path(str(folder), "Checkpoint file")["value"] == "Diffusers folder"
    assert model_tab.source_for_path(str(tmp_path / "x.safetensors"), "Diffusers folder")["value"] == "Checkpoint file"
    assert "value" not in model_tab.source_for_path(str(folder), "Diffusers folder")
    groups = dict(model_tab.form_groups(ui))
    assert {"perceptual_lambda", "snr_gamma", "noise_offset"} <= set(groups["regularisation"])
    assert not any(n.startswith("perceptual_") for n in groups.get("diagnostics", []))


def test_every_problem_is_listed_named_by_label_and_its_accordion_marked(ui, tmp_path: Path) -> None:
    """Issue 12.6: a bad learning rate and a missing dataset are both listed; fields are named by their
    label, shown as errors, and the accordion holding a bad field opens and is marked."""
    from extension.tabs import model as model_tab

    raw = raw_form(ui, learning_rate=-1, lora_rank="many", train_data_dir=str(tmp_path / "missing"),
                   pretrained_model_name_or_path=str(tmp_path), output_dir=str(tmp_path / "run"))
    message, *updates = model_tab._check(ui, *raw)
    assert "does not exist" in message and "Learning rate is -1.0 but must be greater than 0" in message
    assert "LoRA rank is 'many': enter a whole number." in message and "lora_rank" not in message
    fields = dict(zip(ui.form.names, updates[:len(ui.form.names)]))
    assert fields["learning_rate"]["info"].startswith("⚠ ") and fields["learning_rate"]["elem_classes"] == [
        "stabletune-field-error"]
    assert fields["seed"]["elem_classes"] == [] and not fields["seed"]["info"].startswith("⚠")
    marks = dict(zip([g for g, _ in model_tab.form_groups(ui)], updates[len(ui.form.names):]))
    assert marks["optimization"]["label"].startswith("⚠ ") and marks["optimization"]["open"] is True
    assert marks["lora"]["label"].startswith("⚠ ")  # lora_rank
    assert not marks["validation"]["label"].startswith("⚠")


def test_each_browser_follows_its_own_run(ui) -> None:
    """Issue 12.5: attaching a run in one browser (its Train dropdown / Runs tab) does not switch another
    browser's view; every live tab reads the run of the browser asking."""
    from extension.tabs import monitor, runs as runs_tab, train as train_tab

    paths = {}
    for name, steps in (("view-a", 3), ("view-b", 5)):
        writer = RunWriter(ui.settings.runs_dir / name)
        writer.status("training", step=steps, max_steps=10)
        for step in range(1, steps + 1):
            writer.metric(step, loss=1.0 / step)
        paths[name] = writer.paths.root
    before = ui.hub.attached
    assert runs_tab._attach(ui, "view-b")[1]["value"] == "view-b"
    train_tab._attach(ui, "view-b")
    assert ui.hub.attached == before  # nothing global moved
    first, second = {"run": paths["view-a"]}, {"run": paths["view-b"]}
    assert monitor.refresh(ui, first)[0].startswith("3 logged steps")
    assert monitor.refresh(ui, second)[0].startswith("5 logged steps")
    assert train_tab.refresh(ui, first)[0].startswith("**view-a**")
    assert train_tab._control(ui, "pause", "view-b").startswith("Sent **pause** to view-b")
    assert (paths["view-b"] / "control.json").exists() and not (paths["view-a"] / "control.json").exists()
    for path in paths.values():
        RunWriter(path).status("stopped", step=1)


def test_reload_restores_only_what_the_form_still_accepts(ui) -> None:
    """Issue 12.5: the values a browser saved come back on reload, except those that are no longer valid (a
    dropdown choice that is gone, a deleted run, a value of the wrong type), which keep what the page shows."""
    from extension import persist

    RunWriter(ui.settings.runs_dir / "kept-run").status("stopped", step=1)
    saved = {"lora_rank": 8, "lr_scheduler": "cosine", "optimizer": "no-such-optimizer", "output_name": 5,
             "no_such_field": 1, persist.RUN_KEY: "kept-run", persist.TAB_KEY: "Runs"}
    *fields, run = persist.restore(ui, json.dumps(saved))
    shown = dict(zip(ui.form.names, fields))
    assert shown["lora_rank"]["value"] == 8 and shown["lr_scheduler"]["value"] == "cosine"
    assert shown["optimizer"] == {"__type__": "update"} and shown["output_name"] == {"__type__": "update"}
    assert run["value"] == "kept-run"
    assert persist.restore(ui, json.dumps({persist.RUN_KEY: "deleted-run"}))[-1] == {"__type__": "update"}
    assert all(u == {"__type__": "update"} for u in persist.restore(ui, "not json"))


def test_runs_tab_deletes_confirmed_loads_settings_and_zips_a_checkpoint(ui, tmp_path: Path) -> None:
    """Issue 12.9: delete needs the confirmation and never takes a dataset or model; a run's settings load
    into the form; the newest checkpoint downloads as a zip; the live column says yes or no."""
    import zipfile

    from extension.tabs import runs as runs_tab

    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "model_index.json").write_text("{}")  # the config check looks for a diffusers layout
    run = write_run_config({"pretrained_model_name_or_path": str(tmp_path), "train_data_dir": str(data),
                            "output_dir": str(ui.settings.runs_dir / "old-run"), "learning_rate": 3e-4})
    writer = RunWriter(run)
    writer.status("stopped", step=4)
    checkpoint = writer.paths.checkpoints / "step_000004"
    checkpoint.mkdir()
    (checkpoint / "manifest.json").write_text("{}")
    (checkpoint / "adapter.safetensors").write_bytes(b"weights")
    assert set(runs_tab.table(ui).loc[lambda t: t["run"] == "old-run", "live"]) == {"no"}

    message, *form = runs_tab._load_settings(ui, "old-run")
    assert message.startswith("Loaded the") and dict(zip(ui.form.names, form))["learning_rate"]["value"] == 3e-4

    message, files = runs_tab._zip(ui, "old-run")
    with zipfile.ZipFile(files[-1]) as archive:
        assert sorted(archive.namelist()) == ["adapter.safetensors", "manifest.json"]

    assert "Tick the box" in runs_tab._delete(ui, "old-run", False)[0] and run.exists()
    inside = ui.settings.runs_dir / "holds-data"
    (inside / "imgs").mkdir(parents=True)  # a dataset kept inside a run folder
    write_run_config({"pretrained_model_name_or_path": str(tmp_path), "train_data_dir": str(inside / "imgs"),
                      "output_dir": str(inside)})
    assert "move that out first" in runs_tab._delete(ui, "holds-data", True)[0] and (inside / "imgs").exists()
    assert runs_tab._delete(ui, "old-run", True)[0].startswith("Deleted **old-run**")
    assert not run.exists() and data.exists() and tmp_path.exists()


def test_runs_tab_says_how_to_open_tensorboard_logs(ui, tmp_path: Path) -> None:
    """Issue 13.8: a run trained with report_to=tensorboard gets the command that opens its logs (the
    folder the engine writes, RUN/tensorboard); a jsonl-only run gets no such line."""
    from extension.tabs import runs as runs_tab

    (tmp_path / "model_index.json").write_text("{}")
    data = tmp_path / "data"
    data.mkdir()
    common = {"pretrained_model_name_or_path": str(tmp_path), "train_data_dir": str(data)}
    logged = write_run_config({**common, "output_dir": str(ui.settings.runs_dir / "tb run"), "report_to": "tensorboard"})
    plain = write_run_config({**common, "output_dir": str(ui.settings.runs_dir / "plain-run")})
    assert "has written none yet" in runs_tab.tensorboard_hint(logged)  # asked, nothing written yet
    (logged / "tensorboard").mkdir()
    hint = runs_tab.tensorboard_hint(ui.run_path("tb run"))
    assert f"`tensorboard --logdir '{logged / 'tensorboard'}'`" in hint  # quoted: the folder name has a space
    assert runs_tab.tensorboard_hint(plain) == "" and runs_tab.tensorboard_hint(None) == ""
    assert ui.parts["runs.tensorboard"] is not None


def test_dead_engine_shows_failed_with_its_sentence_not_starting(tmp_path: Path) -> None:
    """Issue 12.2/3: a run whose engine died before its first checkpoint reads `failed: <reason>` after a
    UI restart, never `starting` with advice to resume; the sentence leads the Train status line."""
    run = tmp_path / "run"
    writer = RunWriter(run)
    writer.status("starting", step=0)
    data = json.loads(writer.paths.status.read_text())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    RunPaths(run).status.write_text(json.dumps({**data, "pid": dead.pid}))
    RunPaths(run).log.write_text("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
                                 "stabletune_core.data.scan.DatasetError: Dataset folder /d holds no images "
                                 "(.png): put your training images in it or choose another folder.\n")
    hub = RunHub(tmp_path)  # a fresh UI: it did not start this engine
    status = hub.status(run)
    assert status["state"] == "failed" and status["reported_state"] == "starting"
    assert status["error"].startswith("Dataset folder /d holds no images")
    line = status_line("run", status, None)
    assert line.startswith("**run**: **failed**: Dataset folder /d holds no images")
    assert "Traceback" not in line and "resume" not in line.lower() and "ETA" not in line
    RunPaths(run).log.write_text("loading model\n")  # died without a word (OOM killer)
    status = RunHub(tmp_path).status(run)
    assert status["state"] == "failed" and status["error"] == "the trainer process ended before its first checkpoint"


# ---- dataset tab (the scan runs in the engine's Python) ---------------------------------------------------
@pytest.fixture
def shapes_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    sub = folder / "3_wide"
    sub.mkdir(parents=True)
    Image.new("RGB", (64, 64), "red").save(folder / "a.png")
    (folder / "a.txt").write_text("a red square")
    Image.new("RGB", (128, 64), "blue").save(sub / "b.jpg")
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    return folder


def test_scan_through_the_engine_and_edit_a_caption(shapes_dir: Path) -> None:
    result = dataset_view.scan(str(shapes_dir), sys.executable, {"resolution": 64, "bucket_step": 8,
                                                                "min_bucket_reso": 32, "max_bucket_reso": 128})
    assert "error" not in result, result
    assert sorted(Path(i["path"]).name for i in result["items"]) == ["a.png", "b.jpg"]
    assert result["total_with_repeats"] == 4
    assert [Path(s["path"]).name for s in result["skipped"]] == ["broken.png"]
    assert sum(b["images"] for b in result["buckets"]) == 4
    assert "2 usable images" in dataset_view.counts_text(result) and "1 skipped" in dataset_view.counts_text(result)
    thumbs = dataset_view.gallery_items(result["items"])
    assert all(Path(t).exists() and Path(t).parent == dataset_view.THUMB_DIR for t, _ in thumbs)

    image = shapes_dir / "a.png"
    before = image.read_bytes()
    dataset_view.save_caption(str(image), "  a red square, bold  ", "txt")
    assert (shapes_dir / "a.txt").read_text() == "a red square, bold\n"
    assert image.read_bytes() == before
    assert "error" in dataset_view.scan(str(shapes_dir / "nope"), sys.executable, {})


# ---- app.py flags -----------------------------------------------------------------------------------------
def test_app_defaults_to_localhost_and_limits_allowed_paths(tmp_path: Path) -> None:
    options = app.launch_options(app.parse_args(["--runs-dir", str(tmp_path / "runs")]))
    assert options["server_name"] == "127.0.0.1" and options["auth"] is None and options["share"] is False
    assert options["allowed_paths"] == [str((tmp_path / "runs").resolve())]
    options = app.launch_options(app.parse_args(["--listen", "--allow-dir", str(tmp_path), "--port", "9000"]))
    assert options["server_name"] == "0.0.0.0" and options["server_port"] == 9000
    assert app.parse_args([]).port == 7870 != 7860  # issue 12.10: A1111 serves on 7860
    assert str(tmp_path.resolve()) in options["allowed_paths"]


def test_share_always_has_a_login() -> None:
    user, password = app.login(app.parse_args(["--share"]))
    assert user == app.SHARE_USER and len(password) >= 12
    assert app.login(app.parse_args(["--share"]))[1] != password
    assert app.login(app.parse_args(["--share", "--auth", "me:secret:with:colons"])) == ("me", "secret:with:colons")
    with pytest.raises(SystemExit):
        app.login(app.parse_args(["--auth", "nopassword"]))


def test_share_password_is_printed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    launched = {}
    monkeypatch.setattr("extension.ui.build_ui", lambda settings: _FakeBlocks(launched))
    app.main(["--share", "--port", str(free_port()), "--runs-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "password" in out and launched["auth"][1] in out and launched["share"] is True


def test_listen_without_auth_gets_a_printed_password(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys) -> None:
    """Issue 12.10: --listen is reachable by the network like --share: a generated login, printed."""
    launched = {}
    monkeypatch.setattr("extension.ui.build_ui", lambda settings: _FakeBlocks(launched))
    port = free_port()
    app.main(["--listen", "--port", str(port), "--runs-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert launched["server_name"] == "0.0.0.0" and launched["auth"][0] == app.SHARE_USER
    assert f"'{launched['auth'][1]}'" in out and f"0.0.0.0:{port}" in out
    assert app.login(app.parse_args(["--listen", "--auth", "me:pw"])) == ("me", "pw")


def test_busy_port_is_one_sentence(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, str(ROOT / "app.py"), "--port", str(port), "--runs-dir",
                               str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode != 0 and "Traceback" not in done.stderr + done.stdout
    assert done.stderr.strip() == f"StableTune: port {port} is in use (another StableTune, or a WebUI?); pass " \
                                  "--port N with a free port."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _FakeBlocks:
    def __init__(self, record: dict):
        self.record = record

    def queue(self) -> "_FakeBlocks":
        return self

    def launch(self, server_name=None, server_port=None, share=False, auth=None, allowed_paths=None) -> None:
        self.record.update(server_name=server_name, share=share, auth=auth, allowed_paths=allowed_paths)


def test_demo_runs_are_not_copied_into_the_webui(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 12.14: a LoRA of the tiny demo model is no SD1 LoRA; only real runs get the copy marker."""
    from extension import webui

    cache = tmp_path / "cache"
    monkeypatch.setenv("STABLETUNE_CACHE", str(cache))
    monkeypatch.setattr(webui, "unload_checkpoint", lambda: "unloaded")
    demo, real = tmp_path / "demo-run", tmp_path / "real-run"
    for run, model in ((demo, cache / "demo-v1" / "tiny-sd1"), (real, tmp_path / "sd15.safetensors")):
        run.mkdir()
        (run / "config.toml").write_text(f'pretrained_model_name_or_path = "{model}"\n')
    note = webui.before_start(demo, tmp_path / "Lora")
    assert "not copied" in note and not (demo / webui.MARKER).exists()
    (demo / "output").mkdir()
    (demo / "output" / "demo_lora.safetensors").write_bytes(b"lora")
    (demo / "status.json").write_text('{"state": "finished"}')
    assert webui.copy_finished_lora(demo) is None and not (tmp_path / "Lora").exists()
    assert webui.before_start(real, tmp_path / "Lora") == "unloaded" and (real / webui.MARKER).exists()


def test_ui_modules_do_not_shell_out() -> None:
    """No shell strings anywhere in the UI or the launcher (argv lists only)."""
    sources = [*ROOT.glob("extension/**/*.py"), ROOT / "app.py", ROOT / "stabletune_core" / "launch.py"]
    for path in sources:
        text = path.read_text()
        assert "shell=True" not in text and "os.system" not in text and "os.popen" not in text, path


def test_resume_button_restarts_the_attached_run_from_its_checkpoint(tmp_path: Path, shapes_dir: Path) -> None:
    from extension.context import UIContext
    from extension.settings import UISettings
    from extension.tabs import train

    (tmp_path / "model_index.json").write_text("{}")  # the config check looks for a diffusers layout
    run = write_run_config({"pretrained_model_name_or_path": str(tmp_path), "train_data_dir": str(shapes_dir),
                            "output_dir": str(tmp_path / "runs" / "old")})
    RunWriter(run).status("stopped", step=7)
    _, fields = load_schema()
    ctx = UIContext(settings=UISettings(runs_dir=tmp_path / "runs", engine_python=fake_engine(tmp_path)),
                    hub=RunHub(tmp_path / "runs"), form=Form(fields), groups=[])
    ctx.hub.attach(run)
    message, *_ = train._continue_run(ctx, "old")
    assert message.startswith("Started **old**"), message
    assert TrainConfig.from_toml(RunPaths(run).config).resume_from_checkpoint == "auto"
    assert train.free_run_dir(run) == tmp_path / "runs" / "old-2"  # Start never reuses a run's folder


def test_train_status_shows_the_runs_learning_summary_when_it_ends() -> None:
    summary = ("Learning summary (first -> last sampling; concept hue error against its training images, kept "
               "colours' drift against the base's own images at the same prompt and seed): purple: 61 deg off -> 4 "
               "deg off; kept: red drift 1 deg, green drift 2 deg; shapes 92 %.")
    assert summary in status_line("demo", {"state": "finished", "step": 400, "max_steps": 400, "summary": summary},
                                  None)
    assert summary not in status_line("demo", {"state": "training", "step": 4, "summary": summary}, None)


def test_heatmap_axes_end_at_the_last_step_and_columns_sit_on_their_steps() -> None:
    """Issue 25.11: steps measured unevenly (every 20, then where the run ended, 113) draw each column over its own
    step, and the axis runs from the first step to the last, not past it."""
    steps = [0, 20, 40, 60, 80, 100, 113]
    records = [{"step": step, "module": f"m{m}", "sv": [3.0, 1.0, 0.1], "effective_rank": 2.0 + step / 1000}
               for step in steps for m in range(3)]
    for figure in (diagnostics.rank_heatmap(records), diagnostics.heatmap(records, "m1")):
        axes = figure.axes[0]
        assert axes.get_xlim() == (0.0, 113.0)
        edges = sorted({round(float(x), 3) for x in axes.collections[0].get_coordinates()[0, :, 0]})
        assert edges == [0.0, 10.0, 30.0, 50.0, 70.0, 90.0, 106.5, 113.0]
        assert all(a <= s <= b for s, a, b in zip(steps, edges, edges[1:]))


def test_a_paused_run_that_renders_sample_now_shows_no_eta(ui) -> None:
    """Issue 25.11: Sample now on a paused run makes the engine report `sampling`; the run is still paused, so
    the status line says so and shows no ETA."""
    from extension.tabs import train as train_tab

    run = ui.settings.runs_dir / "paused-sampling"
    writer = RunWriter(run)
    for step in range(1, 11):
        writer.metric(step, loss=0.1)
    writer.event("pause", "Paused at step 10.", step=10)
    writer.status("sampling", step=10, max_steps=100)  # this process's pid: alive
    line = train_tab.refresh(ui, {"run": run})[0]
    assert "paused (rendering Sample now)" in line and "ETA" not in line, line
    writer.event("unpaused", "Continuing from step 10.", step=10)
    assert "ETA" in train_tab.refresh(ui, {"run": run})[0]  # continued: sampling at a validation step has one
    writer.status("stopped", step=10)
