"""The run's state on disk and back: checkpoints (save, resume), random-number state, adapter weights."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..lora.inject import adapter_settings, load_lora_state_dict, lora_state_dict
from .checkpoint import CheckpointError, list_checkpoints, prune_checkpoints, save_checkpoint
from .ema import AdapterEMA
from .outcome import RunFailed
from .session import Session, TrainState


def rng_state(s: Session) -> dict[str, Any]:
    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": torch.tensor(py_state, dtype=torch.int64), "python_version": py_version,
        "numpy": torch.from_numpy(np_state[1].astype(np.int64)), "numpy_pos": int(np_state[2]),
        "torch": torch.get_rng_state(), "loop": s.generator.get_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(s: Session, rng: dict[str, Any]) -> None:
    random.setstate((rng["python_version"], tuple(int(x) for x in rng["python"].tolist()), None))
    np.random.set_state(("MT19937", rng["numpy"].numpy().astype(np.uint32), rng["numpy_pos"], 0, 0.0))
    torch.set_rng_state(rng["torch"])
    s.generator.set_state(rng["loop"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


CHECKPOINT_FAILURE_LIMIT = 3  # checkpoints in a row that may fail (a full disk) before the run stops


def save(s: Session, reason: str) -> Path | None:
    """Write a checkpoint. A failed one (a full disk) is one console line and the run goes on, keeping the last
    good checkpoint; CHECKPOINT_FAILURE_LIMIT failures in a row stop the run with a sentence."""
    s.accelerator.wait_for_everyone()
    if not s.accelerator.is_main_process:
        return None
    s.run.status("saving", step=s.state.step)
    adapter = adapter_state(s)
    state = {"train": s.state.as_dict(), "optimizer": s.optimizer.state_dict(),
             "lr_scheduler": s.lr_scheduler.state_dict(), "scaler": s.amp.state_dict(), "rng": rng_state(s),
             "guards": {g.name: g.state_dict() for g in [*s.guards, *s.observers]},  # observers' too
             "ema": s.ema.state_dict() if s.ema else {},
             "adapter_settings": adapter_settings(s.config)}  # a resume with other ones is refused (setup.py)
    try:
        folder = save_checkpoint(s.run.paths.checkpoint(s.state.step), s.state.step, adapter, state,
                                 halfway=s.checkpoint_halfway)
    except CheckpointError as exc:
        s.checkpoint_failures += 1
        s.run.event("checkpoint_failed", str(exc), step=s.state.step, console=True)
        if s.checkpoint_failures >= CHECKPOINT_FAILURE_LIMIT:
            raise RunFailed(f"Stopped at step {s.state.step} because {s.checkpoint_failures} checkpoints in a row "
                            f"could not be written ({exc.reason or exc}); {last_good_sentence(s)}") from None
        s.run.status("training", step=s.state.step, max_steps=s.max_steps, error=str(exc))
        return None
    s.checkpoint_failures = 0
    protect = {s.best_checkpoint} if s.best_checkpoint else set()
    removed = prune_checkpoints(s.run.paths.checkpoints, s.config.checkpoints_total_limit, protect=protect)
    s.run.event("checkpoint", f"Saved checkpoint at step {s.state.step} ({reason}).", step=s.state.step,
                path=str(folder), removed=[str(p) for p in removed])
    return folder


def last_good_sentence(s: Session) -> str:
    """What to do after checkpoints failed, naming the last good one (lower case: it ends a sentence)."""
    folders = list_checkpoints(s.run.paths.checkpoints)
    if not folders:
        return "free some space and start the run again (it has no checkpoint yet)."
    return f"free some space and continue with --resume auto from the last good checkpoint, {folders[-1].name}."


def resume(s: Session) -> None:
    """Continue from the checkpoint setup found (setup read and verified it before loading the model)."""
    checkpoint = s.resume_from
    if checkpoint is None:
        return
    s.resume_from = None  # its tensors are not needed once loaded
    restore_adapter(s, checkpoint.adapter)
    state = checkpoint.state
    s.optimizer.load_state_dict(state["optimizer"])
    s.lr_scheduler.load_state_dict(state["lr_scheduler"])
    s.amp.load_state_dict(state["scaler"])
    s.state = TrainState(**state["train"])
    restore_rng(s, state["rng"])
    if s.ema and state.get("ema"):
        s.ema.load_state_dict(state["ema"])
    elif s.ema:  # the checkpoint was made without EMA: average from here on
        s.ema = AdapterEMA(s.params, s.config.ema_decay, on_cpu=s.config.ema_on_cpu)
        s.run.event("config", f"{checkpoint.path.name} holds no EMA weights (ema_decay was 0 then); the EMA starts "
                    f"from the resumed weights at step {s.state.step}.", step=s.state.step, console=True)
    for guard in [*s.guards, *s.observers]:
        guard.load_state_dict(state.get("guards", {}).get(guard.name, {}))
    s.run.event("resumed", f"Resumed from {checkpoint.path} at step {s.state.step} ({s.state.images_seen} images "
                f"seen, micro-batch {s.state.micro_batch_size}).", step=s.state.step, path=str(checkpoint.path),
                images_seen=s.state.images_seen)


def adapter_state(s: Session) -> dict[str, torch.Tensor]:
    """Copies of the trained modules' adapter tensors as '<prefix>.<peft key>': a checkpoint's `adapter`, which
    `restore_adapter` puts back."""
    return {f"{prefix}.{key}": value for prefix, module in s.trained.items()
            for key, value in lora_state_dict(s.accelerator.unwrap_model(module)).items()}


def restore_adapter(s: Session, adapter: dict[str, torch.Tensor]) -> None:
    """Load checkpoint adapter tensors ('<prefix>.<peft key>') into the trained modules."""
    by_prefix: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in adapter.items():
        prefix, name = key.split(".", 1)
        by_prefix.setdefault(prefix, {})[name] = value
    for prefix, module in s.trained.items():
        load_lora_state_dict(s.accelerator.unwrap_model(module), by_prefix.get(prefix, {}))
