"""Lower the rank of a kohya-format LoRA file by SVD, module by module (kohya's resize_lora, done exactly).

A module's update is dW = (alpha / r) * up @ down (conv LoRAs flattened: down [r, in, kh, kw] is an
r x (in*kh*kw) matrix, up [out, r, 1, 1] an out x r one). Its best rank-N approximation in the Frobenius
norm (Eckart-Young) keeps the N largest singular directions. The singular values come from `svd.spectra`
(the numbers the Diagnostics tab charts), so "energy kept" here is the same quantity: the fraction of
||dW||_F^2 = sum of sv^2 that the kept directions carry. The new factors come from the same r x r trick
(two thin QRs and a small SVD), never from an SVD of the full out x in matrix.

The new alpha is alpha * N / r, so alpha / rank (the scale every loader applies) is unchanged and the
resized factors carry the kept directions at their true size. The input file is never modified.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .export import precalculate_sshs_hashes
from .names import ALPHA, DOWN, UP
from .svd import Spectrum, spectra


class ResizeError(ValueError):
    """The resize cannot be done as asked; the message is one sentence."""


@dataclass
class ModuleResize:
    module: str
    old_rank: int
    new_rank: int
    energy_kept: float  # fraction of ||dW||_F^2 the kept directions carry


def lora_file_problem(path: Path) -> str | None:
    """Why `path` is not a LoRA file that can be opened (one sentence), read without loading it; None when it
    can be. For every command that takes a LoRA file (resize, inspect)."""
    from ..config import safetensors_problem

    if path.is_dir():
        return f"{path} is a folder, not a LoRA file; give the path of a LoRA .safetensors file."
    if not path.is_file():
        return f"{path} does not exist; give the path of a LoRA .safetensors file."
    problem = safetensors_problem(path)
    return f"{path} {problem}; give a complete kohya/A1111 LoRA .safetensors file." if problem else None


def read_kohya_lora(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    if problem := lora_file_problem(path):
        raise ResizeError(problem)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except Exception as exc:  # not a safetensors file at all
        raise ResizeError(f"{path} is not a readable .safetensors file ({type(exc).__name__}); "
                          "give a kohya/A1111 LoRA file.") from None


def is_bundled(key: str) -> bool:
    """A pivotal-tuning embedding bundled in the LoRA file (lora/pivotal.py `bundle_tensors`), not a module."""
    return key.startswith("bundle_emb.")


def lora_modules(tensors: dict[str, torch.Tensor], path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """{module: (down, up, alpha)}; refuses files that hold anything but plain LoRA factors."""
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    others = [k for k in tensors if not k.endswith((f".{DOWN}", f".{UP}", f".{ALPHA}")) and not is_bundled(k)]
    if others:
        raise ResizeError(f"{path.name} is not a plain LoRA (it holds '{others[0]}'); resize handles files of "
                          "lora_down/lora_up factors only (not DoRA, LoHa or LoKr).")
    for key in tensors:
        if not key.endswith(f".{DOWN}") or is_bundled(key):
            continue
        name = key[: -len(DOWN) - 1]
        up = tensors.get(f"{name}.{UP}")
        if up is None:
            raise ResizeError(f"{path.name} has a lora_down without its lora_up for '{name}'; the file is damaged.")
        down = tensors[key]
        if up.shape[1] != down.shape[0]:
            raise ResizeError(f"{path.name} is damaged: '{name}' has a lora_down of rank {down.shape[0]} but a "
                              f"lora_up of rank {up.shape[1]}; export the LoRA again.")
        alpha = tensors.get(f"{name}.{ALPHA}")
        if not all(bool(torch.isfinite(t).all()) for t in (down, up, *([] if alpha is None else [alpha]))):
            raise ResizeError(f"{path.name} holds NaN or infinite values (first in '{name}'), so it has no rank to "
                              "keep; use a LoRA exported before the run went non-finite.")
        modules[name] = (down, up, float(alpha) if alpha is not None else float(down.shape[0]))  # kohya: alpha=r
    if not modules:
        raise ResizeError(f"{path.name} holds no LoRA modules; give a kohya/A1111 LoRA file.")
    return modules


def chosen_rank(spectrum: Spectrum, rank: int | None, energy: float | None) -> tuple[int, float]:
    """(new rank, energy kept) of one module: the smallest rank keeping `energy`, capped at `rank`."""
    square = [s * s for s in spectrum.singular_values]
    total = sum(square)
    old = len(square)
    if total <= 0:  # an untrained module: one zero direction keeps all (none) of it
        return 1, 1.0
    new = min(rank or old, old)
    if energy is not None:
        kept = 0.0
        for n, value in enumerate(square, start=1):
            kept += value
            if kept >= energy * total * (1 - 1e-9):
                new = min(new, n)
                break
    return new, sum(square[:new]) / total


@torch.no_grad()
def truncated_factors(down: torch.Tensor, up: torch.Tensor, new_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(down', up') of rank `new_rank` whose product is the best rank-new_rank approximation of up @ down,
    in the input's shapes (conv kernels kept) and dtype; the singular values are split evenly between them."""
    a = down.reshape(down.shape[0], -1).double()  # r x K
    b = up.reshape(up.shape[0], -1).double()  # out x r
    q_b, r_b = torch.linalg.qr(b, mode="reduced")
    q_a, r_a = torch.linalg.qr(a.T, mode="reduced")
    u, s, vh = torch.linalg.svd(r_b @ r_a.T)
    n = min(new_rank, s.shape[0])
    root = s[:n].sqrt()
    new_up = (q_b @ u[:, :n]) * root
    new_down = root[:, None] * (vh[:n] @ q_a.T)
    if n < new_rank:  # a module thinner than the asked rank: pad with zero directions
        new_up = torch.cat([new_up, new_up.new_zeros(new_up.shape[0], new_rank - n)], dim=1)
        new_down = torch.cat([new_down, new_down.new_zeros(new_rank - n, new_down.shape[1])], dim=0)
    down_shape = (new_rank, *down.shape[1:])
    up_shape = (up.shape[0], new_rank, *up.shape[2:])
    return new_down.reshape(down_shape).to(down.dtype).contiguous(), new_up.reshape(up_shape).to(up.dtype).contiguous()


def resize_tensors(tensors: dict[str, torch.Tensor], path: Path, *, rank: int | None = None,
                   energy: float | None = None) -> tuple[dict[str, torch.Tensor], list[ModuleResize]]:
    """The resized tensors and what happened to each module."""
    modules = lora_modules(tensors, path)
    current = max(down.shape[0] for down, _, _ in modules.values())
    if rank is None and energy is None:
        raise ResizeError("Give --rank N or --energy E (for example --energy 0.95).")
    if rank is not None and rank > current:
        raise ResizeError(f"--rank {rank} is above this LoRA's rank {current}; a resize can only lower the rank.")
    if rank is not None and rank < 1:
        raise ResizeError(f"--rank {rank} is not a rank; give a whole number from 1 to {current}.")
    if energy is not None and not 0 < energy <= 1:
        raise ResizeError(f"--energy {energy} is not a fraction; give a number above 0 and at most 1, e.g. 0.95.")
    names = list(modules)
    factors = [(name, modules[name][0].reshape(modules[name][0].shape[0], -1).float(),
                modules[name][1].reshape(modules[name][1].shape[0], -1).float(),
                modules[name][2] / modules[name][0].shape[0]) for name in names]
    out: dict[str, torch.Tensor] = {}
    report = []
    for name, spectrum in zip(names, spectra(factors)):
        down, up, alpha = modules[name]
        old = down.shape[0]
        new, kept = chosen_rank(spectrum, rank, energy)
        new_down, new_up = truncated_factors(down, up, new)
        out[f"{name}.{DOWN}"], out[f"{name}.{UP}"] = new_down, new_up
        out[f"{name}.{ALPHA}"] = torch.tensor(alpha * new / old, dtype=torch.float32)  # alpha/rank unchanged
        report.append(ModuleResize(name, old, new, kept))
    out.update({k: v for k, v in tensors.items() if is_bundled(k)})  # pivotal tuning's words: no rank, kept
    return out, report


def target_path(source: Path, rank: int | None, energy: float | None) -> Path:
    if energy is not None:
        tag = f"e{energy * 100:g}".replace(".", "_")
        tag += f"-max{rank}" if rank is not None else ""
    else:
        tag = f"r{rank}"
    return source.with_name(f"{source.stem}-{tag}.safetensors")


def resize_metadata(metadata: dict[str, str], report: list[ModuleResize], tensors: dict[str, torch.Tensor],
                    how: str) -> dict[str, str]:
    ranks = {m.new_rank for m in report}
    alphas = {round(float(tensors[f"{m.module}.{ALPHA}"]), 6) for m in report}
    energies = [m.energy_kept for m in report]
    note = (f"resized by SVD ({how}) from rank {max(m.old_rank for m in report)} to "
            f"{'/'.join(str(r) for r in sorted(ranks))}; energy kept per module: min {min(energies):.2%}, "
            f"mean {sum(energies) / len(energies):.2%}")
    out = dict(metadata)
    # kohya writes "Dynamic" when the modules end with different ranks; loaders read the per-module tensors.
    out["ss_network_dim"] = str(ranks.pop()) if len(ranks) == 1 else "Dynamic"
    out["ss_network_alpha"] = str(alphas.pop()) if len(alphas) == 1 else "Dynamic"
    comment = out.get("ss_training_comment", "")
    out["ss_training_comment"] = f"{comment}; {note}" if comment and comment != "None" else note
    out["stabletune_resize"] = note
    out["sshs_model_hash"], out["sshs_legacy_hash"] = precalculate_sshs_hashes(tensors, out)
    return out


def resize_file(source: Path, *, rank: int | None = None, energy: float | None = None,
                ) -> tuple[Path, list[ModuleResize]]:
    """Write SOURCE-rN.safetensors (or -eXX) beside the source; never replaces an existing file."""
    from safetensors import SafetensorError

    from .export import _atomic_save

    source = Path(source)
    target = target_path(source, rank, energy)
    if target.exists():
        raise ResizeError(f"{target} already exists; move or delete it first (resize never overwrites a file).")
    tensors, metadata = read_kohya_lora(source)
    resized, report = resize_tensors(tensors, source, rank=rank, energy=energy)
    how = f"energy {energy}" + (f", at most rank {rank}" if rank else "") if energy is not None else f"rank {rank}"
    try:
        _atomic_save(resized, target, resize_metadata(metadata, report, resized, how))
    except (OSError, SafetensorError) as exc:  # a read-only folder, a full disk: the source stays as it was
        reason = getattr(exc, "strerror", None) or str(exc).splitlines()[0]
        raise ResizeError(f"Cannot write {target} ({reason}); copy the LoRA to a folder you can write to with "
                          "free space, and resize it there.") from None
    return target, report


def report_table(report: list[ModuleResize]) -> str:
    """One console table: every module's rank change and energy kept, then min and mean."""
    width = max(len(m.module) for m in report)
    lines = [f"{'module':<{width}}  rank      energy kept"]
    lines += [f"{m.module:<{width}}  {m.old_rank:>3} -> {m.new_rank:<3}  {m.energy_kept:8.2%}" for m in report]
    energies = [m.energy_kept for m in report]
    lines.append(f"{len(report)} modules; energy kept: min {min(energies):.2%}, "
                 f"mean {sum(energies) / len(energies):.2%}")
    return "\n".join(lines)


def suggest_rank(found: list[Spectrum], energy: float = 0.99) -> str | None:
    """The Diagnostics tab's offer, e.g. "this LoRA uses ~5 of its 16 ranks: resize to 8 keeps 99 % of its
    energy", or None when no smaller power-of-two rank keeps `energy` of the total ||dW||_F^2.

    "Uses" is the mean effective rank of the trained modules; the offered rank is the smallest power of two
    below the current rank that keeps `energy` of the energy summed over all modules.
    """
    trained = [sp for sp in found if sp.singular_values and sp.singular_values[0] > 0]
    if not trained:
        return None
    current = max(len(sp.singular_values) for sp in trained)
    total = sum(s * s for sp in trained for s in sp.singular_values)
    uses = sum(sp.effective_rank for sp in trained) / len(trained)
    candidate = 1
    while candidate < current:
        kept = sum(s * s for sp in trained for s in sp.singular_values[:candidate]) / total
        if kept >= energy:
            percent = math.floor(kept * 100 + 1e-6)  # never claim more than is kept
            return (f"this LoRA uses ~{round(uses)} of its {current} ranks: resize to {candidate} keeps "
                    f"{percent} % of its energy")
        candidate *= 2
    return None
