"""Quantised storage of the frozen base weights (``base_storage``): the denoiser's Linear layers kept in 8 or 4 bits
(or fp8 on a GPU that has it) and dequantised one layer at a time when they compute. The LoRA on top stays in its
training precision and trains as before; only the frozen weight it adapts is stored smaller.

Formats (weight-only; activations and the matmul stay in the run's dtype):

* ``int8``: per output channel absmax, ``w = q * absmax / 127`` (q in [-127, 127]): 1 byte a weight + 4 bytes a row.
* ``nf4``: QLoRA's NormalFloat-4 code book in blocks of 64 weights, each with its absmax (fp32), two codes a byte:
  0.5 byte a weight + 4 bytes per 64.
* ``fp8``: float8 e4m3 with a per-output-channel scale (absmax / 448): 1 byte a weight + 4 bytes a row. Only on a
  CUDA GPU with native fp8 (compute capability 8.9 and up: RTX 40xx, L4, H100 and newer); elsewhere it is refused.

Why our own module rather than bitsandbytes or torchao (both checked against torch 2.14.1: neither pulls another
torch): bitsandbytes 0.50.2 does run Linear8bitLt / Linear4bit forward and backward on the CPU, but it is an
optional 43 MB package this project does not install (the adamw8bit optimizer treats it as optional), its CPU 4-bit
kernel is a further optional download (kernels-community), and peft would then wrap bnb layers through another code
path than every other run's; torchao 0.18's weight-only configs are tensor subclasses meant for inference, and
training a LoRA through them on the CPU is not something its maintainers test. What training needs is small:
store the weight smaller, give the forward its dequantised copy, and in the backward pass only the gradient for the
input (the weight is frozen). That is ``_FrozenLinearFunction``, which saves the *quantised* tensors for backward and
dequantises again there, so autograd never keeps a full-size copy of a frozen weight (with or without gradient
checkpointing). The layer is still an ``nn.Linear`` (its ``weight`` is a property giving the dequantised tensor), so
peft's LoRA (and DoRA, which reads the base weight) wrap it as any other Linear.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

#: base_storage values that quantise (the config's "full" keeps the weights in the run's mixed-precision dtype).
QUANTISED_STORAGES = ("int8", "nf4", "fp8")
NF4_BLOCK = 64
#: QLoRA's NormalFloat-4 code book (Dettmers et al. 2023, and bitsandbytes' table), ascending.
NF4_CODE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0])
FP8_MAX = 448.0  # the largest float8_e4m3fn value
#: bytes a weight takes in each storage, and the per-group scale's cost (for the memory model)
BYTES_PER_WEIGHT = {"int8": 1.0, "nf4": 0.5, "fp8": 1.0}


def storage_problem(storage: str, device: torch.device) -> str | None:
    """One sentence when `storage` cannot run on `device`; None when it can (or when nothing is quantised)."""
    if storage != "fp8":
        return None
    if device.type != "cuda":
        return ("base_storage fp8 needs a CUDA GPU with native fp8 (RTX 40xx, L4, H100 or newer) and this run has "
                "none; use base_storage int8 or nf4, which run anywhere.")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"base_storage fp8 needs a GPU with native fp8 (compute capability 8.9 or newer) and "
                f"{torch.cuda.get_device_name(device)} has {major}.{minor}; use base_storage int8 or nf4.")
    return None


# --------------------------------------------------------------------------- the formats
def quantise(weight: torch.Tensor, storage: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of a 2-D weight: int8 / fp8 codes [out, in] with one fp32 scale per row; nf4 codes packed
    two to a byte over the flattened weight padded to blocks of 64, with one fp32 absmax per block."""
    w = weight.detach().float()
    if storage == "int8":
        absmax = w.abs().amax(dim=1, keepdim=True)
        scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
        return torch.round(w / scale).clamp_(-127, 127).to(torch.int8), scale
    if storage == "fp8":
        absmax = w.abs().amax(dim=1, keepdim=True)
        scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
        return (w / scale).to(torch.float8_e4m3fn), scale
    if storage == "nf4":
        flat = w.reshape(-1)
        flat = F.pad(flat, (0, (-flat.numel()) % NF4_BLOCK)).view(-1, NF4_BLOCK)
        absmax = flat.abs().amax(dim=1, keepdim=True)
        absmax = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        midpoints = (NF4_CODE[1:] + NF4_CODE[:-1]) / 2  # nearest code: which interval between codes it falls in
        codes = torch.bucketize(flat / absmax, midpoints).to(torch.uint8).view(-1)
        return (codes[0::2] << 4 | codes[1::2]).contiguous(), absmax
    raise ValueError(f"unknown base storage '{storage}'")


#: Weights dequantised at a time. The whole layer's fp32 values (and nf4's 8-byte indices) held at once cost ~25
#: bytes a weight for nf4 and ~9 for int8, measured (bench/cpu_peak.py's dispatch counter): for Klein 9B's largest
#: layer 3.7 GiB beside the 0.6 GiB of its two bf16 copies. In chunks, the scratch is a constant (SCRATCH_BYTES
#: per weight of one chunk, at most ~72 MiB) and the layer costs its output in the run's dtype; models/memory.py
#: prices both. The values are bitwise those of one pass: each element is computed alone.
DEQUANTISE_CHUNK = 1 << 23
#: Scratch bytes per weight of a chunk: int8/fp8 their fp32 values; nf4 its unpacked codes (1), their int32
#: indices (4) and fp32 values (4).
SCRATCH_BYTES = {"int8": 4, "fp8": 4, "nf4": 9}


def dequantise(codes: torch.Tensor, scale: torch.Tensor, storage: str, shape: tuple[int, int],
               dtype: torch.dtype) -> torch.Tensor:
    """The weight `quantise` stored, as a `shape` tensor of `dtype` (computed in fp32, DEQUANTISE_CHUNK weights at
    a time)."""
    if storage in ("int8", "fp8"):
        out = torch.empty(shape, dtype=dtype, device=codes.device)
        rows = max(1, DEQUANTISE_CHUNK // shape[1])
        for start in range(0, shape[0], rows):
            out[start:start + rows] = codes[start:start + rows].float().mul_(scale[start:start + rows])
        return out
    blocks = scale.shape[0]
    packed = codes.view(blocks, NF4_BLOCK // 2)
    out = torch.empty(blocks, NF4_BLOCK, dtype=dtype, device=codes.device)
    code_book = NF4_CODE.to(codes.device)
    step = max(1, DEQUANTISE_CHUNK // NF4_BLOCK)
    for start in range(0, blocks, step):
        part = packed[start:start + step]
        indices = torch.stack((part >> 4, part & 0x0F), dim=-1).view(-1, NF4_BLOCK).int()  # uint8 would be a mask
        out[start:start + step] = code_book[indices].mul_(scale[start:start + step])
    return out.view(-1)[: shape[0] * shape[1]].view(shape)


class _FrozenLinearFunction(torch.autograd.Function):
    """y = x W^T + b with W dequantised from its codes; backward gives the input's gradient only (W and b are
    frozen), dequantising again rather than keeping W alive between the passes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                storage: str, shape: tuple[int, int]) -> torch.Tensor:
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        weight = dequantise(codes, scale, storage, shape, dtype)
        ctx.save_for_backward(codes, scale)
        ctx.storage, ctx.shape, ctx.dtype, ctx.input_dtype = storage, shape, dtype, x.dtype
        return F.linear(x.to(dtype), weight, None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        codes, scale = ctx.saved_tensors
        weight = dequantise(codes, scale, ctx.storage, ctx.shape, grad.dtype)
        return (grad @ weight).to(ctx.input_dtype), None, None, None, None, None


class QuantisedLinear(torch.nn.Linear):
    """A frozen nn.Linear whose weight is stored quantised (see the module docstring)."""

    keeps_buffer_dtypes = True  # its codes and scales are never cast to the run's dtype (block swap asks this)

    def __init__(self, linear: torch.nn.Linear, storage: str) -> None:
        torch.nn.Module.__init__(self)  # not nn.Linear's: it would allocate a full-size weight
        self.in_features, self.out_features, self.storage = linear.in_features, linear.out_features, storage
        codes, scale = quantise(linear.weight, storage)
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        """The dequantised weight, in the bias's dtype (the run's weight dtype once placed): what DoRA and peft read."""
        dtype = self.bias.dtype if self.bias is not None else torch.float32
        return dequantise(self.codes, self.scale, self.storage, (self.out_features, self.in_features), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FrozenLinearFunction.apply(x, self.codes, self.scale, self.bias, self.storage,
                                           (self.out_features, self.in_features))

    def _apply(self, fn, recurse=True):
        """Casting the model to the run's dtype casts the bias, never the codes (fp8 codes are floating point too)
        or the scales: those stay fp32 (as bitsandbytes keeps its absmax), so a bf16 scale does not add its error to
        the quantisation's. Moves to another device apply to all."""
        kept = {name: self._buffers[name] for name in ("codes", "scale")}
        super()._apply(fn, recurse)
        for name, tensor in kept.items():
            self._buffers[name] = tensor.to(self._buffers[name].device)
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, storage={self.storage}"


#: Linear layers never quantised: a causal LM's output head (Qwen3's, tied to its token embeddings, which stay as
#: they are: quantising the head would store the shared table twice; a text encoder's hidden states never use it).
SKIPPED_LAYERS = ("lm_head",)


def quantise_linear_layers(model: torch.nn.Module, storage: str) -> int:
    """Replace every nn.Linear of `model` by a QuantisedLinear in `storage` (before any adapter is added), except
    SKIPPED_LAYERS; returns how many were replaced. The model must be frozen: its Linear weights are not trained."""
    replaced = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and child_name not in SKIPPED_LAYERS:
                setattr(module, child_name, QuantisedLinear(child, storage))
                replaced += 1
    return replaced


def stored_bytes(model: torch.nn.Module) -> int:
    """The bytes a model's parameters and buffers take as stored (quantised codes and scales included)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def storage_bytes(model: torch.nn.Module, storage: str, dtype_bytes: int = 2) -> int:
    """The bytes `model` takes once `quantise_linear_layers(model, storage)` has run and the model is cast to a
    `dtype_bytes`-wide dtype ("full": nothing quantised), from shapes alone: exact for a model on the meta device
    (the memory model's weight bytes of the real sizes, in seconds, without weights)."""
    total, seen = 0, set()
    for name, module in model.named_modules():
        quantised = (storage in QUANTISED_STORAGES and type(module) is torch.nn.Linear
                     and name.rpartition(".")[2] not in SKIPPED_LAYERS)
        for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            if quantised and name == "weight":
                total += _quantised_weight_bytes(tensor.shape, storage)
            else:
                total += tensor.numel() * (dtype_bytes if tensor.is_floating_point() else tensor.element_size())
    return total


def _quantised_weight_bytes(shape: torch.Size, storage: str) -> int:
    rows, count = shape[0], shape.numel()
    if storage == "nf4":
        padded = -(-count // NF4_BLOCK) * NF4_BLOCK
        return padded // 2 + padded // NF4_BLOCK * 4  # two codes a byte, an fp32 absmax a block
    return count + rows * 4  # a byte a weight, an fp32 scale a row
