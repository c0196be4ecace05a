"""The one walk over a model's peft LoRA layers: export, spectra, the weight-norm guard and the activation
statistics all see the same layers, named the same way.

A layer's update is ``delta W = scaling x up @ down`` (for a Conv2d LoRA, ``down`` is a conv of the layer's
kernel and ``up`` a 1x1 conv: flattened, the same product). A DoRA layer also has a magnitude vector, and its
weight becomes ``magnitude x (W + delta W) / ||W + delta W||`` (lora/dora.py says along which axis).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

#: What wrappers (peft's PeftModel, torch.compile, DDP) put in front of module paths.
WRAPPER_PREFIXES = ("base_model.model.", "_orig_mod.", "module.")


@dataclass(frozen=True)
class LoraLayerView:
    """One LoRA layer. The tensors are the live parameters (not copies): the weight-norm guard scales them."""

    path: str  # module path in the unwrapped model, e.g. "down_blocks.0.attentions.0.proj_in"
    module: torch.nn.Module  # the peft layer (base layer + adapters), for forward hooks
    down: torch.Tensor  # lora_A weight: rank x in (Conv2d: rank x in x kh x kw)
    up: torch.Tensor  # lora_B weight: out x rank (Conv2d: out x rank x 1 x 1)
    scaling: float  # peft's multiplier of up @ down (alpha / rank, or alpha / sqrt(rank) with rsLoRA)
    configured_alpha: float  # lora_alpha as configured
    dropout: float  # dropout on the LoRA path's input while training
    magnitude: torch.Tensor | None  # DoRA's magnitude vector, None for plain LoRA
    dora_on_input: bool  # the magnitude is per input channel (StableTune's, the WebUIs' form), not peft's per output
    up_module: torch.nn.Module  # the lora_B module, whose output is the LoRA path's (unscaled) contribution

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def kohya_alpha(self) -> float:
        """The alpha that reproduces ``scaling`` under kohya's rule ``scale = alpha / rank``: the configured
        one when it does, else scaling x rank (rsLoRA's ``alpha / sqrt(r)`` is folded in, so it round-trips)."""
        if abs(self.configured_alpha / self.rank - self.scaling) <= 1e-6 * max(1.0, abs(self.scaling)):
            return self.configured_alpha
        return self.scaling * self.rank


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model under torch.compile's and DDP's wrappers."""
    model = getattr(model, "_orig_mod", model)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return model


def clean_path(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name


def iter_lora_layers(model: torch.nn.Module, adapter_name: str = "default") -> Iterator[LoraLayerView]:
    """Every peft LoRA layer (Linear or Conv2d) of `model` carrying `adapter_name`, in registration order.
    LoHa / LoKr layers are not LoRA layers and are not walked (lora/lycoris.py reads those)."""
    from peft.tuners.lora import LoraLayer

    for name, module in unwrap(model).named_modules():
        if not isinstance(module, LoraLayer) or adapter_name not in module.lora_A:
            continue
        dropout = module.lora_dropout[adapter_name]
        magnitudes = getattr(module, "lora_magnitude_vector", {})
        dora = magnitudes[adapter_name] if adapter_name in magnitudes else None
        yield LoraLayerView(
            path=clean_path(name),
            module=module,
            down=module.lora_A[adapter_name].weight,
            up=module.lora_B[adapter_name].weight,
            scaling=float(module.scaling[adapter_name]),
            configured_alpha=float(module.lora_alpha[adapter_name]),
            dropout=float(getattr(dropout, "p", 0.0)),
            magnitude=None if dora is None else dora.weight,
            dora_on_input=bool(getattr(dora, "per_input_channel", False)),  # dora.py's InputAxisDora
            up_module=module.lora_B[adapter_name],
        )


def run_lora_layers(trained: dict[str, torch.nn.Module], unwrap_model=lambda m: m
                    ) -> Iterator[tuple[str, LoraLayerView]]:
    """("<prefix>.<path>", layer) for every LoRA layer of a run's trained models ({"unet": ..., "te0": ...}),
    UNet first; `unwrap_model` is the accelerator's (it removes the wrappers accelerate adds)."""
    for prefix, model in trained.items():
        for layer in iter_lora_layers(unwrap_model(model)):
            yield f"{prefix}.{layer.path}", layer


@contextmanager
def adapters_off(models: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Inside, every peft adapter layer of `models` passes its base layer's output through unchanged (peft's own
    disable flag): the base model's images. No weight and no requires_grad is touched, so afterwards the adapters are
    bitwise and exactly as trainable as before."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for model in models for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, disabled in zip(layers, before):
            layer._disable_adapters = disabled
