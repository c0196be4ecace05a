"""RUN/diagnostics/image_losses.jsonl: one line per optimizer step with each sample's loss (the loop writes it
through `RunWriter.image_losses`; the doctor ranks the images from it, tools/image_losses.py):

    {"step": 120, "paths": ["/data/10_cat/a.png", ...], "losses": [0.081, ...], "timesteps": [523, ...],
     "reg": [false, ...]}

one entry per sample of the step's micro-batches: the image's path as the dataset scan gave it, its loss before
any per-timestep weighting and before `prior_loss_weight`, the timestep (a flow model: its sigma) it was noised
at, and whether it is a class image."""
from __future__ import annotations

from typing import Any, Sequence


def loss_record(step: int, paths: Sequence[Any], losses: Sequence[float], timesteps: Sequence[float],
                reg: Sequence[bool] | None = None) -> dict[str, Any]:
    """The line the loop appends for one optimizer step (all its micro-batches' samples, in order)."""
    if not len(paths) == len(losses) == len(timesteps):
        raise ValueError(f"{len(paths)} paths, {len(losses)} losses and {len(timesteps)} timesteps: one each per "
                         "sample.")
    record: dict[str, Any] = {"step": int(step), "paths": [str(p) for p in paths],
                              "losses": [float(v) for v in losses], "timesteps": [float(t) for t in timesteps]}
    if reg is not None:
        record["reg"] = [bool(r) for r in reg]
    return record
