"""`python -m stabletune_core extract --base BASE --tuned TUNED --output LORA.safetensors`: a LoRA from a fine-tune.

For every layer a LoRA usually trains (the UNet's transformer blocks, the text encoders' attention and MLP;
with `--conv_rank` also every layer of the UNet's ResNets and samplers; FLUX.2 Klein: its blocks' modules under
BFL's names, lora_file.walk_layers), dW = W_tuned - W_base is split by SVD into its best
rank-N factors (Eckart-Young): N is `--rank`, or per layer the smallest rank keeping `--energy` of ||dW||_F^2
(with `--rank` as the ceiling). Layers whose largest change is below `--min_diff` are left out (a text encoder
the fine-tune did not train). The file is in the kohya/A1111 format with alpha = rank (scale 1), names as
StableTune exports them, and metadata saying how it was made. The checkpoints are only read.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .common import check_new_output, progress, refuse
from .merge import PRECISIONS


def add_parser(commands: Any) -> None:
    p = commands.add_parser("extract", help="Extract a LoRA from a fine-tuned checkpoint against its base by SVD "
                            "(--rank or --energy).")
    p.add_argument("--base", required=True, help="The base checkpoint (single .safetensors file or diffusers folder).")
    p.add_argument("--tuned", required=True, help="The fine-tuned checkpoint of the same model family.")
    p.add_argument("--output", required=True, help="The new LoRA .safetensors file.")
    p.add_argument("--rank", type=int, default=None, help="Rank of every module (default 32 without --energy).")
    p.add_argument("--energy", type=float, default=None,
                   help="Per module, the smallest rank keeping this fraction of ||dW||^2 (e.g. 0.95).")
    p.add_argument("--conv_rank", type=int, default=0, help="Also extract the UNet's 3x3 convolutions at this "
                   "rank (LoCon; 0: attention layers only).")
    p.add_argument("--min_diff", type=float, default=1e-5, help="Leave out layers whose largest weight change is "
                   "below this.")
    p.add_argument("--no_text_encoder", action="store_true", help="UNet layers only.")
    p.add_argument("--model_config_dir", default=None, help="Config folder describing single files of an unusual "
                   "architecture.")
    p.add_argument("--save_precision", choices=PRECISIONS, default="fp16")
    p.set_defaults(run_tool=run)


def svd_factors(delta, rank: int | None, energy: float | None):
    """(down, up, rank, energy kept) of the best low-rank split of one layer's update (conv kernels kept)."""
    import torch

    from ..lora.resize import chosen_rank
    from ..lora.svd import Spectrum

    matrix = delta.double().flatten(1)
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    values = s.tolist()
    new, kept = chosen_rank(Spectrum("", values, [], 0.0, 0.0, 0.0, 0.0), rank, energy)
    root = s[:new].sqrt()
    up = u[:, :new] * root
    down = root[:, None] * vh[:new]
    if delta.dim() == 4:
        return down.reshape(new, *delta.shape[1:]), up.reshape(delta.shape[0], new, 1, 1), new, kept
    return down, up, new, kept


def extract(base: str, tuned: str, output: Path, *, rank: int | None = None, energy: float | None = None,
            conv_rank: int = 0, min_diff: float = 1e-5, text_encoder: bool = True, config_dir: str | None = None,
            save_precision: str = "fp16") -> tuple[list[Any], list[str]]:
    """Write the LoRA; returns the per-module report and notes (components left out)."""
    import torch

    from ..lora.export import _atomic_save, build_kohya_metadata, precalculate_sshs_hashes
    from ..lora.names import ALPHA, DOWN, UP
    from ..lora.resize import ModuleResize
    from ..models import get_family
    from .lora_file import walk_layers
    from ..train.amp import precision_dtype
    from .merge import base_family, load_base

    found = [base_family(p) for p in (base, tuned) if Path(p).expanduser().exists()]
    if len(set(found)) > 1:
        names = " and ".join(get_family(name).display_name for name in found)
        raise refuse(f"The base and the tuned checkpoints are of different model families ({names}); extract a "
                     "LoRA from a fine-tune against its own base.")
    family = found[0] if found else None
    if conv_rank and family and not get_family(family).denoiser_has_convolutions:
        raise refuse(f"{get_family(family).display_name} has no convolutions to extract; leave out --conv_rank.")
    base_bundle = load_base(base, config_dir, family)
    tuned_bundle = load_base(tuned, config_dir, family)
    tuned_layers = {name: layer for _, name, layer in walk_layers(tuned_bundle, conv=conv_rank > 0)}
    wanted = [(component, name, layer) for component, name, layer in walk_layers(base_bundle, conv=conv_rank > 0)
              if text_encoder or component == "unet"]
    tensors: dict[str, Any] = {}
    report: list[ModuleResize] = []
    unchanged: dict[str, int] = {}
    dtype = precision_dtype(save_precision)
    with torch.no_grad():
        for component, name, layer in progress(wanted, len(wanted), "extracting", unit="layer"):
            other = tuned_layers.get(name)  # layer, other: lora_file.LayerTarget (FLUX.2's q/k/v one fused target)
            if other is None or other.weight.shape != layer.weight.shape:
                raise refuse(f"The tuned checkpoint's layer '{name}' does not match the base's; they are not the same "
                             "architecture.")
            delta = other.weight.double() - layer.weight.double()
            if float(delta.abs().max()) < min_diff:
                unchanged[component] = unchanged.get(component, 0) + 1
                continue
            is_conv = delta.dim() == 4 and delta.shape[-1] != 1
            cap = conv_rank if is_conv else rank
            down, up, new, kept = svd_factors(delta, cap if cap else (None if energy else 32), energy)
            tensors[f"{name}.{DOWN}"] = down.to(dtype).contiguous()
            tensors[f"{name}.{UP}"] = up.to(dtype).contiguous()
            tensors[f"{name}.{ALPHA}"] = torch.tensor(float(new), dtype=torch.float32)  # alpha / rank = 1
            report.append(ModuleResize(name, min(delta.flatten(1).shape), new, kept))
    if not report:
        raise refuse(f"The two checkpoints do not differ in any layer a LoRA trains (largest change below "
                     f"--min_diff {min_diff}); nothing to extract.")
    notes = [f"{component}: {n} layer(s) unchanged (below --min_diff), left out" for component, n in unchanged.items()]
    ranks = {m.new_rank for m in report}
    single = ranks.pop() if len(ranks) == 1 else None
    energies = [m.energy_kept for m in report]
    how = f"energy {energy}" + (f", at most rank {rank}" if rank else "") if energy else f"rank {rank or 32}"
    note = (f"extracted by SVD ({how}) from {Path(tuned).name} against {Path(base).name}; energy kept per module: "
            f"min {min(energies):.2%}, mean {sum(energies) / len(energies):.2%}")
    metadata = build_kohya_metadata(output, base_bundle.family, rank=single or max(m.new_rank for m in report),
                                    alpha=float(single or max(m.new_rank for m in report)),
                                    metadata={"ss_sd_model_name": Path(base).name, "ss_training_comment": note,
                                              "stabletune_extract": json.dumps({"base": Path(base).name,
                                                                                "tuned": Path(tuned).name,
                                                                                "how": how})})
    if single is None:
        metadata["ss_network_dim"] = metadata["ss_network_alpha"] = "Dynamic"
    if conv_rank:
        metadata["ss_network_args"] = json.dumps({"conv_dim": conv_rank, "conv_alpha": conv_rank})
    metadata["sshs_model_hash"], metadata["sshs_legacy_hash"] = precalculate_sshs_hashes(tensors, metadata)
    _atomic_save(tensors, output, metadata)
    return report, notes


def run(args: argparse.Namespace) -> int:
    from ..lora.resize import report_table

    output = Path(args.output).expanduser()
    if output.suffix.lower() != ".safetensors":
        raise refuse(f"The LoRA must be a .safetensors file, not '{output.name}'.")
    check_new_output(output)
    if args.rank is not None and args.rank < 1:
        raise refuse(f"The rank {args.rank} (--rank) is not a rank; give a whole number of 1 or more.")
    if args.energy is not None and not 0 < args.energy <= 1:
        raise refuse(f"The energy {args.energy} (--energy) is not a fraction; give a number above 0 and at most 1, "
                     "e.g. 0.95.")
    if args.conv_rank < 0:
        raise refuse(f"--conv_rank {args.conv_rank} is not a rank; give a whole number of 1 or more (0: no "
                     "convolutions).")
    if not 0 <= args.min_diff < float("inf"):  # NaN fails this too
        raise refuse(f"--min_diff {args.min_diff} is not a weight change; give a number of 0 or more, e.g. 1e-5.")
    for which in ("base", "tuned"):
        if not Path(getattr(args, which)).expanduser().exists():
            raise refuse(f"The {which} checkpoint {getattr(args, which)} does not exist; give a .safetensors file or "
                         "a diffusers folder.")
    report, notes = extract(args.base, args.tuned, output, rank=args.rank, energy=args.energy,
                            conv_rank=args.conv_rank, min_diff=args.min_diff, text_encoder=not args.no_text_encoder,
                            config_dir=args.model_config_dir, save_precision=args.save_precision)
    print(report_table(report))
    for line in notes:
        print(f"note: {line}")
    print(f"Extracted LoRA written to {output}")
    return 0
