"""Issue 23: FLUX.2 Klein trains through the engine, from the command line, with the stability promise of the SD
families (item 4), on the tiny real-layout Klein (models/tiny_flux2.py, built offline).

Every run here is the real `python -m stabletune_core train` (or the loop in-process where only the loop's
behaviour is looked at); the SD tests' helpers (test_faults.py) drive the processes.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flux2_tools import one_sentence, tiny_klein_paths
from stabletune_core.config import TrainConfig
from stabletune_core.config.families import KLEIN_LORA_TARGETS
from stabletune_core.models.flux2_klein import LORA_PRESETS
from stabletune_core.runs.reader import RunReader

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 900


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return tiny_klein_paths(tmp_path_factory)


def cli(*args: str, faults: str = "") -> subprocess.CompletedProcess:
    from test_faults import environment

    return subprocess.run([sys.executable, "-m", "stabletune_core", "train", *args], cwd=ROOT,
                          env=environment(faults), capture_output=True, text=True, timeout=TIMEOUT)


def small_args(model: Path, data: Path, run: Path, **overrides) -> list[str]:
    values = dict(pretrained_model_name_or_path=model, train_data_dir=data, output_dir=run, resolution=64,
                  bucket_step=8, min_bucket_reso=32, max_bucket_reso=128, train_batch_size=2, learning_rate=1e-3,
                  max_train_steps=4, lora_rank=4, save_precision="fp32", validation_split=0, seed=5)
    values.update(overrides)
    args = []
    for key, value in values.items():
        if value is True:
            args.append(f"--{key}")
        else:
            args += [f"--{key}", str(value)]
    return args


# ---- item 1: the family in the config, knobs that do not apply refused before any model loads ---------------------
def test_klein_lora_targets_are_the_familys_preset():
    assert KLEIN_LORA_TARGETS == LORA_PRESETS["attention"]  # config/families.py cannot import the torch side


@pytest.mark.parametrize("family, knob, value", [
    ("flux2_klein", "snr_gamma", "5"),
    ("flux2_klein", "prediction_type", "v_prediction"),
    ("flux2_klein", "down_lr_scale", "0.5"),
    ("auto", "train_text_encoder", True),  # the family detected from the checkpoint, before it loads
    ("auto", "validation_sampler", "euler_a"),
    ("sd1", "weighting_scheme", "logit_normal"),
    ("sdxl", "flow_shift", "3.0"),
])
def test_knobs_of_another_family_are_refused_in_one_sentence(paths, shapes_dataset, tmp_path, family, knob, value):
    run = tmp_path / "run"
    done = cli(*small_args(paths["folder"], shapes_dataset, run, model_family=family, **{knob: value}))
    assert done.returncode != 0
    error = done.stderr.strip().splitlines()[-1].removeprefix("error: ")
    assert knob in error and one_sentence(error), done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Loading weights" not in done.stderr  # refused before loading
    status = RunReader(run).status()
    assert status["state"] == "failed" and status["error"] == error


# ---- item 2: trains through the real loop from the command line; what was loaded is said; the LoRA loads ----------
def events_of(run: Path, kind: str) -> list[dict]:
    return [e for e in RunReader(run).events() if e["kind"] == kind]


@pytest.fixture(scope="module")
def trained(paths, shapes_dataset, tmp_path_factory):
    """One 4-step CLI run on the tiny Klein base: validation images from a separate (distilled) preview model, the
    LoRA exported in both formats."""
    from stabletune_core.models.tiny_flux2 import build_tiny_klein

    root = tmp_path_factory.mktemp("klein-cli")
    preview = build_tiny_klein(root / "distilled-seed1", seed=1, distilled=True)  # other weights than the base
    run = root / "run"
    done = cli(*small_args(paths["folder"], shapes_dataset, run, model_family="flux2_klein", save_steps=2,
                           validation_prompt="a red circle", validation_steps=4, validation_inference_steps=2,
                           num_validation_images=1, preview_model=preview, export_diffusers_format=True))
    assert done.returncode == 0, done.stderr[-3000:]
    return run, done


def test_trains_from_the_command_line_and_says_what_it_loaded(trained):
    run, done = trained
    status = RunReader(run).status()
    assert status["state"] == "finished" and status["step"] == 4
    metrics = RunReader(run).metrics()
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and all(torch.isfinite(torch.tensor(m["loss"]))
                                                              for m in metrics)
    model = events_of(run, "model")
    assert "FLUX.2 Klein" in model[0]["message"] and "the base model" in model[0]["message"]
    assert model[1]["preview"] and "step-distilled" in model[1]["message"]
    first_step = done.stderr.index("training:")
    assert done.stderr.index(f"model: {model[0]['message']}") < first_step  # said before training
    config = TrainConfig.from_toml(run / "config.toml")
    assert config.unet_lora_targets == KLEIN_LORA_TARGETS  # the SD default stood for Klein's own
    for step in (0, 4):
        assert (run / "samples" / f"step_{step:06d}" / "p00_s5.png").is_file()
    keys = load_file(run / "output" / "lora.safetensors")
    assert any(k.startswith("lora_unet_single_blocks_0_linear1") for k in keys)  # BFL names, single blocks too
    assert (run / "output" / "lora_diffusers" / "pytorch_lora_weights.safetensors").is_file()


def test_preview_model_makes_the_validation_images(trained, paths, tmp_path):
    """The step-4 image is the preview model's (the trained LoRA on it), not the trained model's: rendered again
    from the checkpoint, on each model, it matches the preview."""
    from PIL import Image

    run, _ = trained
    image = torch.tensor(list(Image.open(run / "samples" / "step_000004" / "p00_s5.png").getdata())).float()
    config = TrainConfig.from_toml(run / "config.toml")
    renders = {}
    for name, model in (("trained", None), ("preview", config.preview_model)):
        bundle = trained_bundle(paths, run, 4)
        if model:
            from stabletune_core.train.preview import load_preview, with_trained_adapters

            bundle = with_trained_adapters(load_preview(config, bundle, torch.device("cpu"), torch.float32),
                                           bundle.unet)
        from stabletune_core.train.validation_images import make_validation_images

        path = make_validation_images(bundle, config, tmp_path / name, torch.device("cpu"))[0]
        renders[name] = torch.tensor(list(Image.open(path).getdata())).float()
    assert torch.equal(renders["preview"], image)
    assert (renders["trained"] - image).abs().mean() > 1.0  # the two models' images differ


def trained_bundle(paths, run: Path, step: int):
    """The tiny Klein with the run's adapters as its checkpoint of `step` holds them."""
    from stabletune_core.lora.inject import add_lora, load_lora_state_dict
    from stabletune_core.models import get_family

    config = TrainConfig.from_toml(run / "config.toml")
    bundle = get_family("flux2_klein").load(paths["folder"])
    add_lora(bundle, config)
    adapter = load_file(run / "checkpoints" / f"step_{step:06d}" / "adapter.safetensors")
    load_lora_state_dict(bundle.unet, {k.removeprefix("unet."): v for k, v in adapter.items()})
    bundle.unet.eval()
    return bundle


@pytest.mark.parametrize("fmt", ["kohya", "diffusers"])
def test_exported_lora_gives_the_trained_models_output_in_diffusers(trained, paths, fmt, one_thread):
    """Issue 23 item 2's proof on a trained run: diffusers' own Flux2KleinPipeline.load_lora_weights reads the file
    the run exported and its transformer then computes what the trained one does (1e-5, fp32 files)."""
    from test_flux2_lora import TOLERANCE, fresh_pipeline, output

    run, _ = trained
    expected = output(trained_bundle(paths, run, 4).unet)
    pipe = fresh_pipeline(paths)
    base = output(pipe.transformer)
    file = run / "output" / ("lora.safetensors" if fmt == "kohya" else "lora_diffusers")
    pipe.load_lora_weights(str(file))
    got = output(pipe.transformer)
    assert (expected - base).abs().max() > 1e-3  # four steps did move the model
    assert (got - expected).abs().max() <= TOLERANCE


def test_a_distilled_base_is_named_in_one_sentence_before_training(paths, shapes_dataset, tmp_path):
    run = tmp_path / "run"
    done = cli(*small_args(paths["distilled_folder"], shapes_dataset, run, max_train_steps=1))
    assert done.returncode == 0, done.stderr[-3000:]
    warning = next(e["message"] for e in events_of(run, "model") if "grey or generic" in e["message"])
    assert one_sentence(warning) and "step-distilled" in warning and "preview_model" in warning
    assert done.stderr.index(f"model: {warning}") < done.stderr.index("training:")
