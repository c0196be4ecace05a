"""DoRA (weight-decomposed LoRA) in the form the WebUIs apply, so the exported file reproduces the trained model.

DoRA writes a layer's weight as a magnitude times a direction: W' = m * (W + dW) / ||W + dW||, with
dW = scale x up @ down. Which norm? A1111 (network.py `apply_weight_decompose`) and ComfyUI (`weight_decompose`,
for a `dora_scale` whose first dimension is 1) both take it per *input* channel, over the output and kernel axes
(LyCORIS's default, `wd_on_out=False`), with `dora_scale` shaped (1, in) or (1, in, 1, 1). peft's `use_dora`
normalises per *output* channel instead; A1111 cannot apply that at all and ComfyUI divides by the base weight's
norm there, so a file in peft's form would not reproduce the model in either.

So StableTune lets peft build its DoRA layers (the forward dispatch, parameter names, checkpoints) and swaps
each layer's magnitude module for `InputAxisDora`. Scaling input channel j of W' by c_j = m_j / ||(W + dW)[:, j]||
is scaling input j of x, so the layer computes (W + dW)(c * x) + bias. As in the DoRA paper (and peft), the norm
is treated as a constant in the backward pass.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def column_norms(weight: torch.Tensor) -> torch.Tensor:
    """||W[:, j, ...]|| for every input channel j (shape: in)."""
    return weight.transpose(0, 1).reshape(weight.shape[1], -1).norm(dim=1)


def lora_delta(down: torch.Tensor, up: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """up @ down in the layer's weight shape (conv factors flattened first)."""
    return (up.reshape(up.shape[0], -1) @ down.reshape(down.shape[0], -1)).reshape(shape)


class InputAxisDora(torch.nn.Module):
    """The magnitude of one DoRA layer, one value per input channel; called by peft's DoRA variant in place of
    its own magnitude module, it returns what the layer adds to the base layer's output."""

    per_input_channel = True  # what the layer walker (layers.py) reads: StableTune's form, not peft's

    def __init__(self, base_layer: torch.nn.Module, down: torch.Tensor, up: torch.Tensor, scaling: float) -> None:
        super().__init__()
        if isinstance(base_layer, torch.nn.Conv2d) and (base_layer.groups != 1 or base_layer.padding_mode != "zeros"):
            raise ValueError("DoRA supports plain Conv2d layers only (no groups, zero padding).")
        if not isinstance(base_layer, (torch.nn.Linear, torch.nn.Conv2d)):
            raise ValueError(f"DoRA supports Linear and Conv2d layers, not {type(base_layer).__name__}.")
        with torch.no_grad():
            weight = base_layer.weight.float()
            merged = weight + scaling * lora_delta(down.float(), up.float(), weight.shape)
            self.weight = torch.nn.Parameter(column_norms(merged).to(down.dtype))

    def forward(self, x: torch.Tensor, *, lora_A: torch.nn.Module, lora_B: torch.nn.Module, scaling: float,
                base_layer: torch.nn.Module, base_result: torch.Tensor | None = None,
                adapter_name: str = "default") -> torch.Tensor:
        weight = base_layer.weight
        with torch.no_grad():
            delta = lora_delta(lora_A.weight.float(), lora_B.weight.float(), weight.shape)
            norm = column_norms(weight.float() + scaling * delta)
        factor = self.weight / norm
        if isinstance(base_layer, torch.nn.Conv2d):
            factor = factor.view(1, -1, 1, 1)
        factor = factor.to(x.dtype)
        base_extra = self._base(base_layer, x * (factor - 1))  # W (c x) - W x, without the bias
        return base_extra + lora_B(lora_A(x * factor)) * scaling

    @staticmethod
    def _base(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        weight = layer.weight.to(x.dtype)
        if isinstance(layer, torch.nn.Conv2d):
            return F.conv2d(x, weight, None, layer.stride, layer.padding, layer.dilation, layer.groups)
        return F.linear(x, weight)


def use_input_axis_dora(model: torch.nn.Module, adapter_name: str = "default") -> int:
    """Give every peft DoRA layer of `model` the per-input-channel magnitude; returns how many were changed."""
    from .layers import iter_lora_layers

    changed = 0
    for layer in iter_lora_layers(model, adapter_name):
        if layer.magnitude is None or layer.dora_on_input:
            continue
        module = layer.module
        module.lora_magnitude_vector[adapter_name] = InputAxisDora(module.get_base_layer(), layer.down.detach(),
                                                                   layer.up.detach(), layer.scaling)
        changed += 1
    return changed


def dora_scale(layer) -> torch.Tensor:
    """The `dora_scale` tensor of a layer's export: its magnitude shaped (1, in) or (1, in, 1, 1), the shape the
    WebUIs divide by their per-input-channel norm."""
    magnitude = layer.magnitude.detach()
    return magnitude.reshape(1, -1, *([1] * (layer.down.dim() - 2)))
