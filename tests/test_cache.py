"""Caches and start-up: a latent cache shared between runs (keyed by content), the validation set and the
activation probe built only when first measured, and the cached-away modules kept off the device."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from stabletune_core.runs.reader import RunReader

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def events(run: Path, kind: str) -> list[dict]:
    return [e for e in RunReader(run).events() if e["kind"] == kind]


class CountingEncode:
    """Counts images through the real AutoencoderKL.encode (the VAE still runs)."""

    def __init__(self, monkeypatch) -> None:
        from diffusers import AutoencoderKL

        self.images = 0
        real = AutoencoderKL.encode

        def encode(vae, x, *args, **kwargs):
            self.images += x.shape[0]
            return real(vae, x, *args, **kwargs)

        monkeypatch.setattr(AutoencoderKL, "encode", encode)


# ---- item 8: a content-keyed latent cache outside the runs ----------------------------------------------
def test_second_run_on_the_same_images_encodes_nothing(tiny_config, shapes_dataset, tmp_path, monkeypatch,
                                                       one_thread):
    from stabletune_core.train.loop import train

    monkeypatch.setenv("STABLETUNE_CACHE", str(tmp_path / "cache"))
    settings = dict(cache_latents=True, cache_latents_to_disk=True, max_train_steps=3, validation_loss_every=0,
                    diagnostics_every=0, activation_stats_every=0)
    counter = CountingEncode(monkeypatch)
    train(tiny_config(output_dir=str(tmp_path / "first"), **settings))
    assert counter.images == 8
    first = events(tmp_path / "first", "latent_cache")[0]
    assert (first["encoded"], first["reused"]) == (8, 0)
    stored = sorted((tmp_path / "cache" / "latents").glob("*.safetensors"))
    assert len(stored) == 8 and not (tmp_path / "first" / "cache").exists()  # not in the run folder
    written = {p.name: p.stat().st_mtime_ns for p in stored}

    # The same pictures under another folder, trained by a new run: keyed by content, so all reused.
    copy = tmp_path / "copy"
    shutil.copytree(shapes_dataset, copy)
    counter.images = 0
    train(tiny_config(output_dir=str(tmp_path / "second"), train_data_dir=str(copy), **settings))
    assert counter.images == 0
    second = events(tmp_path / "second", "latent_cache")[0]
    assert (second["encoded"], second["reused"]) == (0, 8) and "reused 8 cached latents" in second["message"]
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cache" / "latents").glob("*")} == written
    # The cached latents are what the first run trained on: the two runs are the same run.
    losses = [[m["loss"] for m in RunReader(tmp_path / run).metrics()] for run in ("first", "second")]
    assert losses[0] == losses[1]

    # An edited image misses (its bytes changed); the others still hit.
    from PIL import Image

    edited = sorted(copy.glob("*.png"))[0]
    Image.new("RGB", (64, 64), (9, 99, 199)).save(edited)
    counter.images = 0
    train(tiny_config(output_dir=str(tmp_path / "third"), train_data_dir=str(copy), **settings))
    assert counter.images == 1
    third = events(tmp_path / "third", "latent_cache")[0]
    assert (third["encoded"], third["reused"]) == (1, 7)


def test_vae_identity_is_its_weights_and_dtype():
    from diffusers import AutoencoderKL

    from stabletune_core.data import module_fingerprint

    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4, sample_size=32)
    same = AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=4, sample_size=32)
    same.load_state_dict(vae.state_dict())
    assert module_fingerprint(vae) == module_fingerprint(same)
    with torch.no_grad():
        same.decoder.conv_out.bias[0] += 1e-3  # a fine-tuned VAE
    assert module_fingerprint(vae) != module_fingerprint(same)
    assert module_fingerprint(vae) != module_fingerprint(vae.to(torch.bfloat16))


# ---- item 7: nothing measured before step 1 is built before step 1 -------------------------------------
def test_validation_set_and_probe_are_built_when_first_needed(tiny_config, tmp_path, monkeypatch, one_thread):
    from stabletune_core.train.loop import setup, train

    counter = CountingEncode(monkeypatch)
    config = tiny_config(output_dir=str(tmp_path / "never"), max_train_steps=2, validation_loss_every=1000,
                         activation_stats_every=1000, diagnostics_every=0, cache_latents=True)
    s = setup(config)
    assert counter.images == 8  # the latent cache, and nothing else
    train(config, session=s)
    assert counter.images == 8  # nothing encoded for a validation that never comes
    observers = {o.name: o for o in s.observers}
    assert observers["validation_loss"].fixed is None and observers["activations"].probe is None
    assert not events(tmp_path / "never", "validation")

    config = tiny_config(output_dir=str(tmp_path / "later"), max_train_steps=4, validation_loss_every=3,
                         activation_stats_every=2, diagnostics_every=0, validation_count=2)
    s = setup(config)
    train(config, session=s)
    built = events(tmp_path / "later", "validation")
    assert [e["step"] for e in built] == [3]  # at its first measurement, not at start-up
    observers = {o.name: o for o in s.observers}
    assert len(observers["validation_loss"].fixed) == 2 and len(observers["activations"].probe) == 1
    lines = (tmp_path / "later" / "diagnostics" / "activations.jsonl").read_text().splitlines()
    assert {json.loads(line)["step"] for line in lines} == {2, 4}


# ---- item 7: modules whose outputs are cached leave the device ------------------------------------------
def test_cached_away_modules_are_kept_on_the_cpu(tiny_config, tmp_path, one_thread):
    from stabletune_core.train.loop import setup, train
    from stabletune_core.train.placement import frozen_modules_to_offload, module_device

    config = tiny_config(max_train_steps=3, cache_latents=True, cache_text_embeddings=True,
                         validation_loss_every=2, activation_stats_every=3, diagnostics_every=0,
                         validation_prompt="a red circle", validation_steps=3, num_validation_images=1,
                         validation_inference_steps=2)
    s = setup(config)
    moved = events(Path(config.output_dir), "placement")
    assert len(moved) == 1 and moved[0]["modules"] == ["vae", "text_encoder_0"]
    assert module_device(s.bundle.vae).type == "cpu" and module_device(s.bundle.text_encoders[0]).type == "cpu"
    train(config, session=s)  # validation loss, the probe and sampling all run with them waiting on the CPU
    assert RunReader(Path(config.output_dir)).status()["state"] == "finished"
    assert len(list((Path(config.output_dir) / "samples").glob("step_000003/*.png"))) == 1
    assert module_device(s.bundle.vae).type == "cpu"

    # What stays: the VAE for the LPIPS term; trained text encoders; anything whose output is not cached.
    bundle = s.bundle
    with_lpips = config.model_copy(update={"perceptual_lambda": 0.1})
    assert list(frozen_modules_to_offload(bundle, with_lpips, latents_cached=True, text_cached=True)) == \
        ["text_encoder_0"]
    te_trained = config.model_copy(update={"train_text_encoder": True})
    assert list(frozen_modules_to_offload(bundle, te_trained, latents_cached=True, text_cached=True)) == ["vae"]
    assert frozen_modules_to_offload(bundle, config, latents_cached=False, text_cached=False) == {}


@cuda
def test_cached_away_modules_leave_the_gpu_and_sampling_brings_the_vae_back(tiny_config):
    from stabletune_core.train.loop import sample, setup
    from stabletune_core.train.placement import module_device

    config = tiny_config(cache_latents=True, cache_text_embeddings=True, validation_prompt="a red circle",
                         num_validation_images=1, validation_inference_steps=2)
    s = setup(config)
    assert module_device(s.bundle.denoiser).type == "cuda"
    assert module_device(s.bundle.vae).type == "cpu" and module_device(s.bundle.text_encoders[0]).type == "cpu"
    before = torch.cuda.memory_allocated()
    sample(s)
    assert list((Path(config.output_dir) / "samples").rglob("*.png"))
    assert module_device(s.bundle.vae).type == "cpu" and torch.cuda.memory_allocated() <= before


def test_gpu_check_script_says_so_on_a_cpu_machine_and_names_real_tests():
    import re
    import subprocess

    script = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.sh"
    for node in re.findall(r"tests/(test_\w+\.py)::(test_\w+)", script.read_text()):
        source = (script.parent.parent / "tests" / node[0]).read_text()
        assert f"def {node[1]}(" in source, f"gpu_check.sh names {node[0]}::{node[1]}, which does not exist"
    if torch.cuda.is_available():
        pytest.skip("the CPU branch is tested on a machine without CUDA")
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA" in lines[0]


def test_placing_the_models_says_nothing_about_fp32_modules_that_no_model_lists():
    """diffusers' ModelMixin.to printed "should be kept in float32: []" twice on every run's console; the
    models are cast all the same (fp16 run: VAE kept fp32, the rest in fp16)."""
    import logging

    from diffusers.utils import logging as diffusers_logging

    from stabletune_core.models.sd.tiny import build_tiny_components
    from stabletune_core.train.placement import cast_and_place, place_models

    heard: list[str] = []
    listener = logging.Handler()
    listener.emit = lambda record: heard.append(record.getMessage())
    logger = logging.getLogger("diffusers")
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_warning()  # an earlier run in this process may have quietened diffusers
    logger.addHandler(listener)
    try:
        parts = build_tiny_components(0)
        bundle = type("Bundle", (), {"vae": parts["vae"], "denoiser": parts["unet"],
                                     "text_encoders": [parts["text_encoder"]]})
        place_models(bundle, torch.device("cpu"), torch.float16, "fp16")
        assert not [m for m in heard if "float32" in m], heard
        assert parts["vae"].dtype == torch.float32 and parts["unet"].dtype == torch.float16
        assert parts["text_encoder"].dtype == torch.float16
        parts["vae"]._keep_in_fp32_modules = ["decoder"]  # a model that lists some still hears diffusers' advice
        cast_and_place(parts["vae"], torch.device("cpu"), torch.float16)
        assert any("should be kept in float32: ['decoder']" in m for m in heard), heard
    finally:
        logger.removeHandler(listener)
        diffusers_logging.set_verbosity(verbosity)
