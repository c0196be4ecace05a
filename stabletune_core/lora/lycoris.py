"""LoHa and LoKr (LyCORIS) layers as the tensors of a LyCORIS file, the format A1111, Forge and ComfyUI load.

peft trains them with the same parameter names LyCORIS files use, in the same orientation (LoHa's
`hada_w1_a` is out x rank, `hada_w1_b` rank x in; LoKr's Kronecker factors `lokr_w1` / `lokr_w2` or their
low-rank halves `_a` / `_b`). What differs is the scale. The loaders apply `alpha / dim`, where dim is the
rank of the low-rank pair (LoHa: `hada_w1_b.shape[0]`; LoKr: `lokr_w2_b`, else `lokr_w1_b`), and 1 when a
LoKr layer has no low-rank pair at all. peft applies `alpha / r` always. So a layer with a low-rank pair
gets `alpha = peft scaling x dim`; a LoKr layer without one has peft's scaling folded into `lokr_w1`.
"""
from __future__ import annotations

from typing import Iterator

import torch

LOHA_PARTS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")
LOKR_PARTS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")


def network_of(model: torch.nn.Module) -> str | None:
    """'loha' or 'lokr' when `model` carries peft LyCORIS layers, else None."""
    from peft.tuners.loha import LoHaLayer
    from peft.tuners.lokr import LoKrLayer

    for module in model.modules():
        if isinstance(module, LoHaLayer):
            return "loha"
        if isinstance(module, LoKrLayer):
            return "lokr"
    return None


def iter_lycoris_modules(model: torch.nn.Module, adapter_name: str = "default"
                         ) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """(module path, {LyCORIS key suffix: tensor, including 'alpha' where the loaders need one}) per layer."""
    from peft.tuners.loha import LoHaLayer
    from peft.tuners.lokr import LoKrLayer

    from .layers import clean_path, unwrap

    for name, module in unwrap(model).named_modules():
        if isinstance(module, LoHaLayer) and adapter_name in module.scaling:
            if adapter_name in getattr(module, "hada_t1", {}):
                raise ValueError(f"'{name}' is a Tucker (CP) LoHa layer; StableTune exports the plain form only.")
            tensors = {part: getattr(module, part)[adapter_name] for part in LOHA_PARTS}
            dim = tensors["hada_w1_b"].shape[0]
            tensors["alpha"] = torch.tensor(float(module.scaling[adapter_name]) * dim)
        elif isinstance(module, LoKrLayer) and adapter_name in module.scaling:
            if adapter_name in getattr(module, "lokr_t2", {}):
                raise ValueError(f"'{name}' is a Tucker (CP) LoKr layer; StableTune exports the plain form only.")
            tensors = {part: getattr(module, part)[adapter_name] for part in LOKR_PARTS
                       if adapter_name in getattr(module, part)}
            scaling = float(module.scaling[adapter_name])
            low_rank = tensors.get("lokr_w2_b", tensors.get("lokr_w1_b"))
            if low_rank is not None:
                tensors["alpha"] = torch.tensor(scaling * low_rank.shape[0])
            else:  # the loaders apply no scale here: fold peft's into the first factor
                first = "lokr_w1" if "lokr_w1" in tensors else "lokr_w1_a"
                tensors[first] = tensors[first] * scaling
        else:
            continue
        yield clean_path(name), tensors


def lycoris_tensors(named_layers: Iterator[tuple[str, dict[str, torch.Tensor]]], dtype: torch.dtype
                    ) -> dict[str, torch.Tensor]:
    """`{kohya module name}.{part}` tensors: factors in `dtype`, alpha as an fp32 scalar."""
    tensors: dict[str, torch.Tensor] = {}
    for name, parts in named_layers:
        for part, value in parts.items():
            key = f"{name}.{part}"
            if key in tensors:
                raise ValueError(f"Two adapter layers map to the same name '{name}'.")
            kind = torch.float32 if part == "alpha" else dtype
            tensors[key] = value.detach().to(device="cpu", dtype=kind).contiguous().clone()
    return tensors
