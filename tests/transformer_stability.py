"""The stability checks the transformer families' tests share (test_flux2_training.py for FLUX.2 Klein,
test_z_image_stability.py for Z-Image): a short run in this process, and what an out-of-memory step, early stopping
and a stopping signal must leave behind, whatever the family."""
from __future__ import annotations

import subprocess
from pathlib import Path

import torch
from safetensors.torch import load_file

from stabletune_core.runs.reader import RunReader

TIMEOUT = 900


def events_of(run: Path, kind: str) -> list[dict]:
    return [e for e in RunReader(run).events() if e["kind"] == kind]


def train_in_process(family: str, model: Path, shapes_dataset: Path, out: Path, **overrides):
    """A 4-step run of `family` from the tiny folder `model` in this process (setup + train); returns the session
    and the run's metrics."""
    from stabletune_core.config import build_config
    from stabletune_core.train.loop import setup, train

    values = dict(model_family=family, pretrained_model_name_or_path=str(model), train_data_dir=str(shapes_dataset),
                  output_dir=str(out), resolution=64, bucket_step=8, min_bucket_reso=32, max_bucket_reso=128,
                  train_batch_size=2, learning_rate=1e-3, max_train_steps=4, lora_rank=4, save_steps=1000, seed=3,
                  save_precision="fp32", validation_split=0)
    config = build_config({**values, **overrides})
    session = setup(config)
    train(config, session=session)
    return session, RunReader(out).metrics()


def losses(metrics: list[dict]) -> list[tuple[float, float]]:
    return [(m["loss"], m["grad_norm"]) for m in metrics]


def assert_caches_train_what_encoding_each_step_trains(family: str, model: Path, shapes_dataset: Path,
                                                       folder: Path) -> None:
    """For a family that encodes the VAE's mode (no posterior sample): a 4-step run on cached latents and text
    embeddings trains the losses and gradient norms of encoding each step; the text is encoded in other batches,
    which moves float sums in the last bits only. The encoders that caching makes idle are placed away."""
    _, plain = train_in_process(family, model, shapes_dataset, folder / "plain")
    session, cached = train_in_process(family, model, shapes_dataset, folder / "cached", cache_latents=True,
                                       cache_text_embeddings=True)
    assert session.inputs.latent_cache is not None and session.inputs.text_cache is not None
    placed = events_of(folder / "cached", "placement")
    assert placed and "vae" in placed[0]["modules"] and "text_encoder_0" in placed[0]["modules"]
    assert len(cached) == 4 and all(m["loss"] == m["loss"] for m in cached)
    torch.testing.assert_close(torch.tensor(losses(cached)), torch.tensor(losses(plain)), rtol=1e-5, atol=0)


def assert_out_of_memory_at_4_kept_the_effective_batch(run: Path) -> None:
    """test_faults' 6-step run (micro-batch 2) with an out-of-memory injected at step 4: the micro-batch halves from
    there on, the images per step stay 2, and the LoRA is finite and trained."""
    assert [(e["step"], e["old_micro_batch"], e["new_micro_batch"]) for e in events_of(run, "oom")] == [(4, 2, 1)]
    metrics = RunReader(run).metrics()
    assert [m["micro_batch_size"] for m in metrics] == [2, 2, 2, 1, 1, 1]
    assert [m["images_seen"] for m in metrics] == [2, 4, 6, 8, 10, 12]  # the effective batch stayed 2
    weights = load_file(run / "output" / "lora.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert any(t.abs().sum() > 0 for k, t in weights.items() if "lora_up" in k)


def assert_stopped_early_and_exported_the_best(run: Path, stopped_at: int, max_steps: int) -> None:
    """The run stopped before max_steps on a held-out loss above its best; lora_best.safetensors is the adapter of
    the best step's checkpoint."""
    from stabletune_core.train.checkpoint import load_checkpoint

    curve = RunReader(run).diagnostics("val_loss.jsonl")
    best = min(curve, key=lambda r: r["val_loss"])
    assert stopped_at < max_steps and curve[-1]["val_loss"] > best["val_loss"]
    (stop,) = events_of(run, "early_stop")
    assert stop["best_step"] == best["step"]
    exported = load_file(run / "output" / "lora_best.safetensors")
    adapter = load_checkpoint(run / "checkpoints" / f"step_{best['step']:06d}").adapter
    down = next(k for k in exported if k.endswith("lora_down.weight"))
    assert any(torch.equal(exported[down], v) for v in adapter.values() if v.shape == exported[down].shape)


def assert_a_signal_stops_with_a_checkpoint_and_the_lora(args: list[str], run: Path, signum: int) -> None:
    """Started from the command line with `args` (a run that would not end by itself), sent `signum` after its
    first step: it exits 128 + signum without a traceback, `stopped`, with the last step's checkpoint and the LoRA."""
    from test_failures import _start, _wait_for_step

    proc = _start(args)
    _wait_for_step(run, proc)
    proc.send_signal(signum)
    try:
        _, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 128 + signum, stderr[-3000:]
    assert "Traceback" not in stderr
    status = RunReader(run).status()
    assert status["state"] == "stopped" and status["step"] >= 1
    assert (run / "checkpoints" / f"step_{status['step']:06d}" / "manifest.json").is_file()
    assert load_file(run / "output" / "lora.safetensors")
