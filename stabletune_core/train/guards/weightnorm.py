"""Max-norm regularisation of the LoRA update (kohya's --scale_weight_norms).

After each optimizer step, every LoRA module whose update W = scale x up @ down has a Frobenius norm above
`max_norm` gets both factors multiplied by sqrt(max_norm / norm), which brings the update's norm to exactly
`max_norm`. This caps how far any single layer can move from the base model, a common cure for a LoRA that
"burns" (overfits into saturated colours) at normal strength.
"""
from __future__ import annotations

from typing import Any

import torch

from ...lora.layers import iter_lora_layers
from .base import Guard, GuardView, Verdicts
from .verdicts import ScaleWeights


def lora_pairs(module: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """(down, up, scaling) of each peft LoRA layer under `module`, adapter 'default'."""
    return [(layer.down, layer.up, layer.scaling) for layer in iter_lora_layers(module)]


def update_norm(down: torch.Tensor, up: torch.Tensor, scaling: float) -> torch.Tensor:
    """||scaling x up @ down||_F without forming the (out x in) product: tr((up^T up)(down down^T))."""
    d = down.reshape(down.shape[0], -1).float()
    u = up.reshape(up.shape[0], -1).float()
    squared = ((u.T @ u) * (d @ d.T)).sum().clamp(min=0)
    return squared.sqrt() * abs(scaling)


class WeightNormGuard(Guard):
    name = "weight_norms"

    def __init__(self, max_norm: float) -> None:
        self.max_norm = max_norm
        self.groups: list[tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]] = []

    def on_start(self, view: GuardView) -> Verdicts:
        """Group the LoRA pairs by shape, so each step is a few batched matmuls instead of one per module."""
        by_shape: dict[tuple, list[tuple[torch.Tensor, torch.Tensor, float]]] = {}
        for module in view.adapters.values():
            for down, up, scaling in lora_pairs(module):
                by_shape.setdefault((down.shape, up.shape, down.device), []).append((down, up, scaling))
        self.groups = [([d for d, _, _ in pairs], [u for _, u, _ in pairs],
                        torch.tensor([abs(c) for _, _, c in pairs], device=pairs[0][0].device))
                       for pairs in by_shape.values()]
        return ()

    @torch.no_grad()
    def after_step(self, view: GuardView, metrics: dict[str, Any]) -> Verdicts:
        if not self.groups:
            return ()
        norms = []
        for downs, ups, scalings in self.groups:
            d = torch.stack([t.reshape(t.shape[0], -1) for t in downs]).float()  # (n, r, in)
            u = torch.stack([t.reshape(t.shape[0], -1) for t in ups]).float()  # (n, out, r)
            squared = (torch.bmm(u.transpose(1, 2), u) * torch.bmm(d, d.transpose(1, 2))).sum((1, 2))
            norms.append(squared.clamp(min=0).sqrt() * scalings)
        flat = torch.cat(norms)
        factors = (self.max_norm / flat.clamp(min=1e-12)).clamp(max=1.0).sqrt()
        scaled = int((factors < 1.0).sum())
        metrics["keys_scaled"] = scaled
        metrics["max_weight_norm"] = float(flat.max())
        if not scaled:
            return ()
        tensors, per_tensor = [], []
        offset = 0
        for downs, ups, _ in self.groups:  # both factors of a pair get sqrt(max_norm / norm)
            f = factors[offset:offset + len(downs)].tolist()
            offset += len(downs)
            tensors += [downs, ups]
            per_tensor += [f, f]
        return (ScaleWeights(tuple(tensors), tuple(per_tensor)),)
