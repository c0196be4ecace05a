"""Max-norm regularisation of the LoRA update (kohya's --scale_weight_norms).

After each optimizer step, every LoRA module whose update W = scale x up @ down has a Frobenius norm above
`max_norm` gets both factors multiplied by sqrt(max_norm / norm), which brings the update's norm to exactly
`max_norm`. This caps how far any single layer can move from the base model, a common cure for a LoRA that
"burns" (overfits into saturated colours) at normal strength.
"""
from __future__ import annotations

from typing import Any

import torch

from .base import Guard, GuardView, Verdicts
from .verdicts import ScaleWeights

class WeightNormGuard(Guard):
    name = "weight_norms"

    def __init__(self, max_norm: float) -> None:
        self.max_norm = max_norm
        # (indices into view.lora_layers, |scaling| of each): the layers grouped by shape. Indices, not the
        # tensors: the guard keeps no live weight of the run.
        self.groups: list[tuple[list[int], torch.Tensor]] = []

    def on_start(self, view: GuardView) -> Verdicts:
        """Group the LoRA layers by shape, so each step is a few batched matmuls instead of one per module."""
        by_shape: dict[tuple, list[int]] = {}
        layers = view.lora_layers
        for i, layer in enumerate(layers):
            by_shape.setdefault((layer.down.shape, layer.up.shape, layer.down.device), []).append(i)
        self.groups = [(indices, torch.tensor([abs(layers[i].scaling) for i in indices],
                                              device=layers[indices[0]].down.device))
                       for indices in by_shape.values()]
        return ()

    @torch.no_grad()
    def after_step(self, view: GuardView, metrics: dict[str, Any]) -> Verdicts:
        if not self.groups:
            return ()
        layers, norms = view.lora_layers, []
        for indices, scalings in self.groups:
            d = torch.stack([layers[i].down.reshape(layers[i].down.shape[0], -1) for i in indices]).float()
            u = torch.stack([layers[i].up.reshape(layers[i].up.shape[0], -1) for i in indices]).float()
            squared = (torch.bmm(u.transpose(1, 2), u) * torch.bmm(d, d.transpose(1, 2))).sum((1, 2))  # (n,)
            norms.append(squared.clamp(min=0).sqrt() * scalings)
        flat = torch.cat(norms)
        factors = (self.max_norm / flat.clamp(min=1e-12)).clamp(max=1.0).sqrt()
        scaled = int((factors < 1.0).sum())
        metrics["keys_scaled"] = scaled
        metrics["max_weight_norm"] = float(flat.max())
        if not scaled:
            return ()
        order = [i for indices, _ in self.groups for i in indices]  # the order of `flat`
        return (ScaleWeights(tuple(order), tuple(factors.tolist())),)  # both factors of a pair: sqrt(max / norm)
