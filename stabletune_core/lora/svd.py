"""Spectral health of LoRA adapters, from the r x r problem only.

A LoRA update is dW = s * B @ A with B (d x r), A (r x k) and s = alpha / r. With the reduced QR
factorisations B = Qb Rb and A^T = Qa Ra, dW = Qb (s * Rb Ra^T) Qa^T, and Qb, Qa have orthonormal columns,
so the singular values of dW are those of the small r x r matrix s * Rb Ra^T. That costs two thin QRs and
one tiny SVD per module instead of an SVD of the full d x k matrix, and modules of the same shape are
done in one batched call.

The numbers per module:
  singular_values  of dW, largest first
  normalized       singular values divided by the largest (sv[1] is "the second normalised singular value")
  effective_rank   exp(entropy) of sv / sum(sv) (Roy & Vetterli 2007): r for a flat spectrum, 1 when collapsed
  stable_rank      ||dW||_F^2 / ||dW||_2^2
  frobenius        ||dW||_F
  up_down_ratio    ||B||_F / ||A||_F (a runaway ratio means one side does all the learning)
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Iterator

import torch

from .layers import iter_lora_layers

_BLOCK = re.compile(r"(down_blocks\.\d+|up_blocks\.\d+|mid_block|input_blocks\.\d+|output_blocks\.\d+|"
                    r"middle_block|encoder\.layers\.\d+)")


@dataclass
class Spectrum:
    module: str
    singular_values: list[float]
    normalized: list[float]
    effective_rank: float
    stable_rank: float
    frobenius: float
    up_down_ratio: float

    def as_record(self) -> dict:
        return asdict(self)


@dataclass
class Collapse:
    """Most modules have lost their second direction; `first_module` is the earliest one in network order."""

    fraction: float
    collapsed: int
    considered: int
    first_module: str
    first_block: str


def lora_factors(model: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.Tensor, torch.Tensor, float]]:
    """(name, A as r x k, B as d x r, scale) of every peft LoRA layer of `model`, in network order.

    Conv LoRAs are flattened to matrices (A: r x (k*kh*kw), B: d x r), which is what their update is.
    """
    for layer in iter_lora_layers(model):
        a, b = layer.down.detach(), layer.up.detach()
        yield (f"{prefix}{layer.path}", a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1), layer.scaling)


@torch.no_grad()
def spectra(factors: list[tuple[str, torch.Tensor, torch.Tensor, float]]) -> list[Spectrum]:
    """Spectra of every (name, A, B, scale), batched over modules of equal shape, in the order given."""
    groups: dict[tuple, list[int]] = {}
    for i, (_, a, b, _) in enumerate(factors):
        groups.setdefault((tuple(a.shape), tuple(b.shape), a.device), []).append(i)
    results: list[Spectrum | None] = [None] * len(factors)
    for indices in groups.values():
        a = torch.stack([factors[i][1] for i in indices]).float()  # n x r x k
        b = torch.stack([factors[i][2] for i in indices]).float()  # n x d x r
        scale = torch.tensor([factors[i][3] for i in indices], device=a.device, dtype=torch.float32)
        _, r_b = torch.linalg.qr(b, mode="reduced")  # n x min(d,r) x r
        _, r_a = torch.linalg.qr(a.transpose(1, 2), mode="reduced")  # n x min(k,r) x r
        small = scale[:, None, None] * r_b @ r_a.transpose(1, 2)
        sv = torch.linalg.svdvals(small)  # n x rank, descending
        top = sv[:, :1]
        normalized = torch.where(top > 0, sv / top.clamp_min(1e-30), torch.zeros_like(sv))
        p = sv / sv.sum(dim=1, keepdim=True).clamp_min(1e-30)
        entropy = -(p * torch.log(p.clamp_min(1e-30))).sum(dim=1)
        effective = torch.where(top[:, 0] > 0, entropy.exp(), torch.zeros_like(entropy))
        square = (sv ** 2).sum(dim=1)
        stable = torch.where(top[:, 0] > 0, square / (top[:, 0] ** 2).clamp_min(1e-30), torch.zeros_like(square))
        ratio = torch.linalg.vector_norm(b, dim=(1, 2)) / torch.linalg.vector_norm(a, dim=(1, 2)).clamp_min(1e-30)
        # One transfer per group: on a GPU every .tolist() is a sync.
        table = torch.cat([sv, normalized, effective[:, None], stable[:, None], square.sqrt()[:, None],
                           ratio[:, None]], dim=1).cpu().tolist()
        width = sv.shape[1]
        for row, i in zip(table, indices):
            results[i] = Spectrum(factors[i][0], row[:width], row[width:2 * width], row[2 * width],
                                  row[2 * width + 1], row[2 * width + 2], row[2 * width + 3])
    return [r for r in results if r is not None]


def block_of(module: str) -> str:
    """The network block a module belongs to (e.g. 'unet.up_blocks.1'), for messages."""
    match = _BLOCK.search(module)
    if match is None:
        return module.rsplit(".", 2)[0]
    return module[: match.end()]


def execution_rank(module: str) -> tuple[int, int]:
    """Where a module runs in the forward pass: text encoder, then down, mid and up blocks.

    named_modules() order is registration order, and diffusers registers up_blocks before mid_block.
    """
    match = _BLOCK.search(module)
    if match is None:
        return (5, 0)
    block = match.group(0)
    index = int(block.rsplit(".", 1)[1]) if block[-1].isdigit() else 0
    kind = block.split(".")[0]
    return ({"encoder": 0, "down_blocks": 1, "input_blocks": 1, "mid_block": 2, "middle_block": 2,
             "up_blocks": 3, "output_blocks": 3}[kind], index)


def detect_collapse(found: list[Spectrum], threshold: float, *, majority: float = 0.5) -> Collapse | None:
    """Collapse when more than `majority` of the trained modules (dW not zero, rank >= 2) have their second
    normalised singular value under `threshold`; the first module is the earliest in the forward pass."""
    considered = [sp for sp in found if len(sp.normalized) >= 2 and sp.singular_values[0] > 0]
    collapsed = [sp for sp in considered if sp.normalized[1] < threshold]
    if not considered or len(collapsed) <= majority * len(considered):
        return None
    first = min(enumerate(collapsed), key=lambda ic: (execution_rank(ic[1].module), ic[0]))[1].module
    return Collapse(len(collapsed) / len(considered), len(collapsed), len(considered), first, block_of(first))
