"""The run's state as a checkpoint holds it, and back: counters, optimizer, schedule, scaler, random-number state,
EMA, the guards' and observers' own state, and the adapter weights. The loop decides when (loop.py `save`,
`resume`); checkpoint.py writes and verifies the files."""
from __future__ import annotations

import random
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from ..lora.inject import load_lora_state_dict, lora_state_dict
from ..lora.pivotal import PivotalTokens
from .amp import MixedPrecision
from .ema import AdapterEMA
from .lr_schedule import LearningRateSchedule
from .ranks import Ranks
from .train_state import TrainState


class Keeper(Protocol):
    """A guard or an observer: something with a name and its own state to keep across a resume."""

    name: str

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def rng_state() -> dict[str, Any]:
    """Python's, numpy's and torch's global random-number state (LoRA dropout draws from torch's)."""
    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": torch.tensor(py_state, dtype=torch.int64), "python_version": py_version,
        "numpy": torch.from_numpy(np_state[1].astype(np.int64)), "numpy_pos": int(np_state[2]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(rng: dict[str, Any]) -> None:
    """Put `rng_state()` back. (Checkpoints before issue 22 also hold a "loop" generator no step drew from.)"""
    random.setstate((rng["python_version"], tuple(int(x) for x in rng["python"].tolist()), None))
    np.random.set_state(("MT19937", rng["numpy"].numpy().astype(np.uint32), rng["numpy_pos"], 0, 0.0))
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def adapter_state(trained: dict[str, torch.nn.Module], ranks: Ranks, pivotal: PivotalTokens | None = None
                  ) -> dict[str, torch.Tensor]:
    """Copies of the trained modules' adapter tensors as '<prefix>.<peft key>', and pivotal tuning's new token
    rows as 'pivotal.te<i>': a checkpoint's `adapter`, which `restore_adapter` puts back."""
    state = {f"{prefix}.{key}": value for prefix, module in trained.items()
             for key, value in lora_state_dict(ranks.unwrap(module)).items()}
    return {**state, **(pivotal.state_dict() if pivotal else {})}


def restore_adapter(trained: dict[str, torch.nn.Module], ranks: Ranks, adapter: dict[str, torch.Tensor],
                    pivotal: PivotalTokens | None = None) -> None:
    """Load checkpoint adapter tensors ('<prefix>.<peft key>') into the trained modules (and the new token rows
    into `pivotal`)."""
    by_prefix: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in adapter.items():
        prefix, name = key.split(".", 1)
        by_prefix.setdefault(prefix, {})[name] = value
    for prefix, module in trained.items():
        load_lora_state_dict(ranks.unwrap(module), by_prefix.get(prefix, {}))
    if pivotal is not None:
        pivotal.load_state_dict(adapter)


def run_state(state: TrainState, optimizer: torch.optim.Optimizer, lr_scheduler: LearningRateSchedule,
              amp: MixedPrecision, ema: AdapterEMA | None, keepers: Sequence[Keeper],
              adapter_settings: dict[str, Any]) -> dict[str, Any]:
    """Everything but the adapter that a resumed run needs to continue exactly (a checkpoint's state.pt), and the
    adapter settings it was trained with (lora.inject.adapter_settings): a resume with other ones is refused
    before anything is written (setup.find_resume_checkpoint)."""
    return {"train": state.counters(), "optimizer": optimizer.state_dict(), "lr_scheduler": lr_scheduler.state_dict(),
            "scaler": amp.state_dict(), "rng": rng_state(),
            "guards": {k.name: k.state_dict() for k in keepers},  # observers' too
            "ema": ema.state_dict() if ema else {}, "adapter_settings": adapter_settings}


def restore_run_state(saved: dict[str, Any], state: TrainState, optimizer: torch.optim.Optimizer,
                      lr_scheduler: LearningRateSchedule, amp: MixedPrecision, ema: AdapterEMA | None,
                      keepers: Sequence[Keeper]) -> bool:
    """Put `run_state`'s dict back. Returns False when the run has an EMA the checkpoint did not keep (it then
    averages from the resumed weights on)."""
    optimizer.load_state_dict(saved["optimizer"])
    lr_scheduler.load_state_dict(saved["lr_scheduler"])
    amp.load_state_dict(saved["scaler"])
    state.restore_counters(saved["train"])
    restore_rng(saved["rng"])
    ema_kept = True
    if ema and saved.get("ema"):
        ema.load_state_dict(saved["ema"])
    elif ema:
        ema.restart()
        ema_kept = False
    for keeper in keepers:
        keeper.load_state_dict(saved.get("guards", {}).get(keeper.name, {}))
    return ema_kept
