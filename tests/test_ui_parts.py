"""The UI's pieces without a browser: schema, form values, validation placement, presets, plots, samples,
diagnostics, status line, the launcher and app.py's flags."""
from __future__ import annotations

import json
import os
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
    assert problems == ["max_train_steps is 'sixty' but must be a number."]


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
    assert by_name["lora_rank"]["info"].startswith("⚠ lora_rank is 0")
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
    items, columns = samples.gallery(reader)
    assert columns == 4 and len(items) == 8
    assert items[0][1] == "step 40 · a red circle · seed 42" and items[4][1].startswith("step 80")
    choices = samples.choices(reader)
    assert choices[0] == samples.ALL and "p01_s43: a blue square · seed 43" in choices
    items, columns = samples.gallery(reader, choices[1])
    assert [label for _, label in items] == ["step 40", "step 80"] and columns == 2


def test_diagnostics_read_spectra_and_warnings(tmp_path: Path) -> None:
    writer = RunWriter(tmp_path)
    from stabletune_core.runs.jsonfiles import append_jsonl

    for step in (0, 50, 100):
        for module, spread in (("up.attn.to_q", 1.0), ("down.attn.to_k", 0.2)):
            values = [spread ** (i * step / 100) for i in range(8)]
            append_jsonl(writer.paths.diagnostics / "spectra.jsonl", {"step": step, "module": module,
                                                                       "singular_values": values})
    writer.event("rank_collapse", "down.attn.to_k effective rank fell below 2.", step=100)
    reader = RunReader(tmp_path)
    records = diagnostics.spectra(reader)
    assert diagnostics.modules(records) == ["down.attn.to_k", "up.attn.to_q"]
    assert diagnostics.effective_rank([1.0] * 8) == pytest.approx(8.0)
    assert diagnostics.effective_rank([1.0, 0.0]) == pytest.approx(1.0)
    assert diagnostics.heatmap(records, "up.attn.to_q") is not None
    assert diagnostics.heatmap(records, "missing") is None
    assert diagnostics.rank_lines(records) is not None
    assert diagnostics.warnings(reader)[0][1] == "rank_collapse"
    assert diagnostics.available(reader) == ["spectra.jsonl"]


def test_status_line() -> None:
    line = status_line("demo", {"state": "training", "step": 40, "max_steps": 120, "sec_per_step": 0.25,
                                "eta_seconds": 20, "loss": 0.1234}, {"kind": "samples", "message": "Made 4 images."})
    assert "step 40/120" in line and "4.00 it/s" in line and "ETA 0:00:20" in line and "Made 4 images" in line
    assert speed(4.0) == "4.00 s/it" and speed(None) == "–"
    assert "engine process is gone" in status_line("x", {"state": "training", "stale": True}, None)


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
    app.main(["--share", "--runs-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "password" in out and launched["auth"][1] in out and launched["share"] is True


class _FakeBlocks:
    def __init__(self, record: dict):
        self.record = record

    def queue(self) -> "_FakeBlocks":
        return self

    def launch(self, server_name=None, server_port=None, share=False, auth=None, allowed_paths=None) -> None:
        self.record.update(server_name=server_name, share=share, auth=auth, allowed_paths=allowed_paths)


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
    message, _ = train._continue_run(ctx)
    assert message.startswith("Started **old**"), message
    assert TrainConfig.from_toml(RunPaths(run).config).resume_from_checkpoint == "auto"
    assert train.free_run_dir(run) == tmp_path / "runs" / "old-2"  # Start never reuses a run's folder
