"""The engine slice end to end on a tiny real-architecture SD1 model: config, CLI, loop, run dir, export."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stabletune_core.cli import main as cli_main
from stabletune_core.config import ConfigError, TrainConfig, build_config, check_inputs
from stabletune_core.data import collate

ROOT = Path(__file__).resolve().parent.parent

SEED_COMMAND = (
    "--pretrained_model_name_or_path P --train_data_dir ./dataset --output_dir ./lora_output --resolution 512 "
    "--train_batch_size 4 --gradient_accumulation_steps 4 --learning_rate 1e-4 --lr_scheduler cosine_with_restarts "
    "--lr_warmup_steps 100 --max_train_steps 1500 --lora_rank 16 --lora_alpha 16 --lora_dropout 0.1 "
    "--perceptual_lambda 0.05 --save_steps 250 --validation_prompt PROMPT --validation_steps 250 "
    "--mixed_precision fp16 --gradient_checkpointing --enable_xformers_memory_efficient_attention"
).split()


def test_seed_command_flags_parse_unchanged():
    import argparse

    from stabletune_core.config import add_config_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    config = config_from_args(parser.parse_args(SEED_COMMAND))
    assert config.pretrained_model_name_or_path == "P"
    assert config.train_data_dir == "./dataset" and config.output_dir == "./lora_output"
    assert (config.resolution, config.train_batch_size, config.gradient_accumulation_steps) == (512, 4, 4)
    assert config.learning_rate == 1e-4 and config.lr_scheduler == "cosine_with_restarts"
    assert (config.lr_warmup_steps, config.max_train_steps, config.save_steps) == (100, 1500, 250)
    assert (config.lora_rank, config.lora_alpha, config.lora_dropout) == (16, 16.0, 0.1)
    assert config.validation_prompt == "PROMPT" and config.validation_steps == 250
    assert config.mixed_precision == "fp16" and config.gradient_checkpointing
    assert config.enable_xformers_memory_efficient_attention
    assert config.perceptual_lambda == 0.05


def test_train_lora_entry_reports_bad_input_before_loading(tmp_path, capsys):
    """The diffusers-style entry point parses the same command and fails fast on the missing folders."""
    args = [a.replace("./dataset", str(tmp_path / "nope")).replace("./lora_output", str(tmp_path / "out"))
            for a in SEED_COMMAND]
    assert cli_main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "Dataset folder" in err and "does not exist" in err
    assert "Model P does not exist" in err or "'P'" in err
    assert "Traceback" not in err  # (a path under ~/.cache/torch may be named: the LPIPS weights check)


@pytest.mark.parametrize("overrides, sentence", [
    ({"resolution": 500}, "resolution: 500 is not a multiple of 8; use 496 or 504."),
    ({"lora_rank": 0}, "lora_rank is 0 but must be at least 1."),
    ({"learning_rate": 0}, "learning_rate is 0 but must be greater than 0."),
    ({"lora_dropout": 1.0}, "lora_dropout is 1.0 but must be less than 1.0."),
    ({"lr_scheduler": "warp"}, "lr_scheduler is 'warp'; choose one of"),
    ({"mixed_precision": "fp8"}, "mixed_precision is 'fp8'; choose one of"),
    ({"output_name": "../evil"}, "output_name: '../evil' is not a plain file name"),
    ({"unet_lora_targets": []}, "unet_lora_targets: is empty"),
    ({"min_bucket_reso": 2048}, "min_bucket_reso (2048) is larger than max_bucket_reso (1024); swap them."),
    ({"shuffle_caption": True, "cache_text_embeddings": True}, "cache_text_embeddings cannot be combined"),
    ({"network_dimm": 4}, "network_dimm is not a StableTune setting"),
])
def test_each_bad_value_gets_its_sentence(overrides, sentence):
    with pytest.raises(ConfigError) as info:
        build_config(overrides)
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith(sentence)


def test_input_checks_name_the_missing_things(tmp_path):
    config = build_config({"train_data_dir": str(tmp_path / "missing"),
                           "pretrained_model_name_or_path": str(tmp_path / "model.safetensors"),
                           "output_dir": str(tmp_path / "run")})
    problems = check_inputs(config)
    assert any("Dataset folder" in p and "does not exist" in p for p in problems)
    assert any("model.safetensors does not exist" in p for p in problems)
    offline = build_config({"train_data_dir": str(tmp_path), "pretrained_model_name_or_path": "someone/some-model"})
    assert any("not in the local hub cache" in p for p in check_inputs(offline))


def test_config_toml_round_trip(tmp_path):
    config = build_config({"lora_rank": 8, "validation_prompt": "a | b", "snr_gamma": 5.0})
    config.save_toml(tmp_path / "c.toml")
    again = TrainConfig.from_toml(tmp_path / "c.toml")
    assert again == config
    assert again.validation_prompts == ["a", "b"]


# ---- training on the tiny model ----------------------------------------------------------------------
def test_loss_on_a_fixed_batch_falls(tiny_config):
    from stabletune_core.train.loop import setup, train

    config = tiny_config(max_train_steps=30, learning_rate=2e-3, lr_scheduler="constant")
    session = setup(config)
    batch = collate([session.data.example(i, 0) for i in range(4)])
    before = session.evaluator.batch_loss(batch)
    train(config, session=session)
    after = session.evaluator.batch_loss(batch)
    assert after < 0.9 * before, (before, after)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_model, shapes_dataset):
    """One short run with validation images and a checkpoint, shared by the run-dir and export tests."""
    from stabletune_core.train.loop import setup, train

    config = build_config(dict(
        pretrained_model_name_or_path=str(tiny_model), train_data_dir=str(shapes_dataset),
        output_dir=str(tmp_path_factory.mktemp("run") / "run"), resolution=64, bucket_step=8, min_bucket_reso=32,
        train_batch_size=2, gradient_accumulation_steps=2, learning_rate=5e-3, max_train_steps=8, lora_rank=4,
        lora_alpha=8, train_text_encoder=True, save_steps=4, validation_prompt="a red circle",
        num_validation_images=1, validation_steps=4, validation_inference_steps=2, save_precision="fp32", seed=5,
        validation_split=0.0))
    session = setup(config)
    path = train(config, session=session)
    return config, session, path


def test_run_directory_holds_everything(trained_run):
    config, session, lora_path = trained_run
    run = Path(config.output_dir)
    assert TrainConfig.from_toml(run / "config.toml") == config
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "finished" and status["step"] == 8 and status["pid"] == os.getpid()
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert all({"loss", "lr", "grad_norm", "sec_per_step", "ram_mb"} <= set(m) for m in metrics)
    events = [json.loads(line)["kind"] for line in (run / "events.jsonl").read_text().splitlines()]
    assert "checkpoint" in events and "exported" in events and events[-1] == "finished"
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["step_000000", "step_000004", "step_000008"]
    assert (run / "samples" / "step_000004" / "p00_s5.png").exists()
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert checkpoints == ["step_000004", "step_000008"]
    manifest = json.loads((run / "checkpoints" / "step_000008" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"adapter.safetensors", "state.pt"}
    assert lora_path == run / "output" / "lora.safetensors" and lora_path.exists()


def _unet_inputs(unet, seed=0):
    g = torch.Generator().manual_seed(seed)
    sample = torch.randn(2, unet.config.in_channels, 8, 8, generator=g)
    hidden = torch.randn(2, 77, unet.config.cross_attention_dim, generator=g)
    return sample, torch.tensor([10, 500]), hidden


def test_exported_lora_loads_in_diffusers_and_reproduces_the_trained_model(trained_run, tiny_model):
    from diffusers import StableDiffusionPipeline

    config, session, lora_path = trained_run
    trained_unet = session.ranks.unwrap(session.trained["unet"]).eval()
    sample, t, hidden = _unet_inputs(trained_unet)
    with torch.no_grad():
        expected = trained_unet(sample, t, encoder_hidden_states=hidden).sample

    pipe = StableDiffusionPipeline.from_pretrained(tiny_model, safety_checker=None, local_files_only=True)
    with torch.no_grad():
        base = pipe.unet(sample, t, encoder_hidden_states=hidden).sample
    pipe.load_lora_weights(str(lora_path))
    with torch.no_grad():
        got = pipe.unet(sample, t, encoder_hidden_states=hidden).sample
    assert not torch.allclose(got, base, atol=1e-4), "the LoRA changed nothing"
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)

    ids = pipe.tokenizer(["a red circle"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    trained_te = session.ranks.unwrap(session.trained["te0"]).eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe.text_encoder(ids)[0], trained_te(ids)[0], atol=1e-5, rtol=1e-4)


def test_exported_keys_alpha_and_metadata(trained_run):
    from safetensors import safe_open

    config, session, lora_path = trained_run
    with safe_open(str(lora_path), "pt") as f:
        keys, metadata = list(f.keys()), f.metadata()
        alphas = {k: float(f.get_tensor(k)) for k in keys if k.endswith(".alpha")}
    assert all(k.startswith(("lora_unet_", "lora_te_text_model_encoder_layers_")) for k in keys)
    assert all(k.endswith((".lora_down.weight", ".lora_up.weight", ".alpha")) for k in keys)
    assert set(alphas.values()) == {8.0}
    assert metadata["ss_network_dim"] == "4" and metadata["ss_network_alpha"] == "8.0"
    assert metadata["ss_base_model_version"] == "sd_v1" and metadata["ss_steps"] == "8"
    assert json.loads(metadata["ss_tag_frequency"])


def test_existing_run_is_never_overwritten(trained_run):
    from stabletune_core.train.setup import RunExists, setup

    config, _, _ = trained_run
    with pytest.raises(RunExists, match="already holds an earlier run"):
        setup(config)


def test_demo_runs_from_the_command_line(tmp_path):
    """What the README's Quick start does, in a subprocess, with a short run."""
    env = {**os.environ, "STABLETUNE_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-m", "stabletune_core", "demo", "--output_dir", str(tmp_path / "demo"),
                             "--max_train_steps", "6"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "demo" / "output" / "demo_lora.safetensors").exists()
    assert "LoRA written to" in result.stdout
    assert "should be kept in float32" not in result.stderr  # diffusers' empty-list advice, no user's concern
    # the demo VAE-encodes its 32 training images once, before step 1, not every step (presets/demo.toml)
    events = [json.loads(line) for line in (tmp_path / "demo" / "events.jsonl").read_text().splitlines()]
    cached = [e for e in events if e.get("kind") == "latent_cache"]
    assert len(cached) == 1 and cached[0]["encoded"] == 32 and "Caching latents" in result.stderr


def test_export_command_writes_a_checkpoints_lora_and_leaves_the_run_alone(trained_run):
    from safetensors.torch import load_file

    config, _, lora_path = trained_run
    run = Path(config.output_dir)
    status_before = (run / "status.json").read_bytes()
    events_before = (run / "events.jsonl").read_bytes()
    assert cli_main(["export", str(run / "checkpoints" / "step_000008"), "--name", "again"]) == 0
    again = load_file(run / "output" / "again.safetensors")
    final = load_file(lora_path)
    assert again.keys() == final.keys()
    for key in final:
        torch.testing.assert_close(again[key], final[key])
    assert (run / "status.json").read_bytes() == status_before
    assert (run / "events.jsonl").read_bytes() == events_before
    assert cli_main(["export", str(run / "checkpoints" / "step_000008"), "--name", "again"]) == 2  # no overwrite
