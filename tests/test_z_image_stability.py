"""Issue 39 item 4 (the rest of the stability promise) on the tiny real-layout Z-Image (models/z_image/tiny.py, built
here, nothing downloaded): an out-of-memory step halves the micro-batch and keeps the effective batch, SIGTERM and
SIGINT end as `stopped` with a last checkpoint and the LoRA, a rising validation loss stops early and exports the
best step (with the spectra recorded on the way), and the latent and text caches train what encoding each step
trains. NaN rollback and exact resume after SIGKILL are in test_z_image.py; the Klein twins in
test_flux2_training.py, whose helpers these reuse.
"""
from __future__ import annotations

import math
import signal

import pytest
import torch
from safetensors.torch import load_file

from test_flux2_training import TIMEOUT, events_of, losses, small_args, train_in_process
from test_z_image import fault_config, folders  # noqa: F401  (folders: the module fixture building the tiny model)
from stabletune_core.models.z_image.family import LORA_PRESETS
from stabletune_core.runs.reader import RunReader


@pytest.fixture(scope="module")
def out_of_memory(tmp_path_factory, folders, shapes_dataset):  # noqa: F811
    """The 6-step fault run with an injected CUDA out-of-memory at step 4, started once, while the in-process
    tests below run."""
    from test_faults import start

    config = fault_config(tmp_path_factory.mktemp("z-image-oom"), folders["base"], shapes_dataset)
    process = start(config, "oom@4")
    yield process, config
    if process.poll() is None:
        process.kill()


def test_out_of_memory_halves_the_micro_batch_and_keeps_the_effective_batch(out_of_memory):
    from test_faults import finish

    process, config = out_of_memory
    finish(process, config)
    run = config.parent / "run"
    assert RunReader(run).status()["state"] == "finished"
    assert [(e["step"], e["old_micro_batch"], e["new_micro_batch"]) for e in events_of(run, "oom")] == [(4, 2, 1)]
    metrics = RunReader(run).metrics()
    assert [m["micro_batch_size"] for m in metrics] == [2, 2, 2, 1, 1, 1]
    assert [m["images_seen"] for m in metrics] == [2, 4, 6, 8, 10, 12]  # the effective batch stayed 2
    weights = load_file(run / "output" / "lora.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert any(t.abs().sum() > 0 for k, t in weights.items() if "lora_up" in k)


def z_image_in_process(folders, shapes_dataset, out, **overrides):  # noqa: F811
    return train_in_process("z_image", folders["base"], shapes_dataset, out, **overrides)


def test_latent_and_text_caches_train_what_encoding_each_step_trains(folders, shapes_dataset, tmp_path,  # noqa: F811
                                                                    one_thread):
    """Z-Image encodes the VAE's mode (no posterior sample), so cached latents are the ones encoded each step; the
    Qwen3 embeddings are encoded in other batches, which moves float sums in the last bits only."""
    _, plain = z_image_in_process(folders, shapes_dataset, tmp_path / "plain")
    session, cached = z_image_in_process(folders, shapes_dataset, tmp_path / "cached", cache_latents=True,
                                         cache_text_embeddings=True)
    assert session.inputs.latent_cache is not None and session.inputs.text_cache is not None
    placed = events_of(tmp_path / "cached", "placement")
    assert placed and "vae" in placed[0]["modules"] and "text_encoder_0" in placed[0]["modules"]
    assert len(cached) == 4 and all(math.isfinite(loss) for loss, _ in losses(cached))
    torch.testing.assert_close(torch.tensor(losses(cached)), torch.tensor(losses(plain)), rtol=1e-5, atol=0)


def test_rising_validation_loss_stops_early_exports_the_best_and_records_spectra(folders, shapes_dataset,  # noqa: F811
                                                                                 tmp_path, one_thread):
    """A rate ramped far too high on six images: the held-out loss falls, then climbs; the tiny model's loss lives
    in a narrow band, so the factor is 1.01 and one trigger stops. The LoRA spectra are recorded on the way."""
    from stabletune_core.train.checkpoint import load_checkpoint

    run = tmp_path / "run"
    session, _ = z_image_in_process(folders, shapes_dataset, run, max_train_steps=60, lora_rank=8,
                                    learning_rate=0.5, lr_scheduler="constant_with_warmup", lr_warmup_steps=50,
                                    validation_split=0.25, validation_loss_every=4, validation_timesteps=4,
                                    unet_lora_targets=LORA_PRESETS["attention_mlp"],
                                    early_stopping=True, early_stopping_window=4, early_stopping_factor=1.01,
                                    early_stopping_patience=1, early_stopping_min_steps=0, diagnostics_every=4,
                                    activation_stats_every=0, checkpoints_total_limit=1, save_steps=4)
    curve = RunReader(run).diagnostics("val_loss.jsonl")
    best = min(curve, key=lambda r: r["val_loss"])
    assert session.state.step < 60 and curve[-1]["val_loss"] > best["val_loss"]
    (stop,) = events_of(run, "early_stop")
    assert stop["best_step"] == best["step"]
    exported = load_file(run / "output" / "lora_best.safetensors")
    adapter = load_checkpoint(run / "checkpoints" / f"step_{best['step']:06d}").adapter
    down = next(k for k in exported if k.endswith("lora_down.weight"))
    assert any(torch.equal(exported[down], v) for v in adapter.values() if v.shape == exported[down].shape)

    spectra = RunReader(run).diagnostics("spectra.jsonl")
    steps = sorted({r["step"] for r in spectra})
    assert steps == list(range(4, session.state.step + 1, 4))
    modules = {r["module"] for r in spectra if r["step"] == steps[-1]}
    assert any(".layers.0.attention.to_q" in m for m in modules) and any("noise_refiner" in m for m in modules)
    assert all(len(r["singular_values"]) == 8 and all(math.isfinite(v) for v in r["singular_values"])
               and r["singular_values"][0] > 0 for r in spectra)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_a_checkpoint_and_the_lora_then_stops(signum, folders, shapes_dataset, tmp_path):  # noqa: F811
    from test_failures import _start, _wait_for_step

    run = tmp_path / "run"
    proc = _start(small_args(folders["base"], shapes_dataset, run, max_train_steps=100000))
    _wait_for_step(run, proc)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 128 + signum, stderr[-3000:]
    assert "Traceback" not in stderr
    status = RunReader(run).status()
    assert status["state"] == "stopped" and status["step"] >= 1
    assert (run / "checkpoints" / f"step_{status['step']:06d}" / "manifest.json").is_file()
    assert load_file(run / "output" / "lora.safetensors")
