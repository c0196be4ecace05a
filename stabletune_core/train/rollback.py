"""In-memory snapshots of the adapter and optimizer state, and the rollback to one (after non-finite steps, the
non-finite guard's `TakeSnapshot` and `RollBack` verdicts, which the loop carries out)."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .checkpoint import latest_good_checkpoint


@dataclass
class Snapshot:
    step: int
    params: list[torch.Tensor]
    optimizer: dict[str, Any]


def take_snapshot(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, step: int) -> Snapshot | None:
    """A copy of the adapter and optimizer state to roll back to; None when the weights are not all finite."""
    with torch.no_grad():
        if not torch.isfinite(torch.nn.utils.get_total_norm(params)):  # one check, not one sync per tensor
            return None
        return Snapshot(step, [p.detach().clone() for p in params], cloned(optimizer.state_dict()))


def restore_snapshot(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, snapshot: Snapshot) -> None:
    """Weights and optimizer back to `snapshot`, which stays as it was (for a later rollback)."""
    with torch.no_grad():
        for p, saved in zip(params, snapshot.params):
            p.copy_(saved)
    optimizer.load_state_dict(cloned(snapshot.optimizer))


def cloned(tree: Any) -> Any:
    """A deep copy of an optimizer state dict that clones its tensors: copy.deepcopy does the same at several
    times the cost (it was a millisecond per step of a small run, snapshots every 20 steps)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {key: cloned(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(cloned(value) for value in tree)
    return copy.copy(tree)


def roll_back(snapshot: Snapshot | None, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
              checkpoints: Path, restore_adapter: Callable[[dict[str, torch.Tensor]], None]) -> str:
    """Weights and optimizer back to the last good state: the in-memory snapshot, else the newest good checkpoint in
    `checkpoints` (`restore_adapter` puts its adapter tensors into the trained modules). Returns what it did, for
    the event's sentence."""
    if snapshot is not None:
        restore_snapshot(params, optimizer, snapshot)
        return f"rolled the LoRA and optimizer back to step {snapshot.step} (in memory)"
    if (checkpoint := latest_good_checkpoint(checkpoints)) is not None:
        restore_adapter(checkpoint.adapter)
        optimizer.load_state_dict(checkpoint.state["optimizer"])
        return f"rolled the LoRA and optimizer back to checkpoint {checkpoint.path.name}"
    return "no good state to roll back to (no snapshot, no checkpoint), kept the current weights"
