"""Mixed precision that the engine owns: autocast around the model's forward, and a GradScaler for fp16.

accelerate can do both (`Accelerator(mixed_precision="fp16")`), but then the fp16 fallback (guards/precision.py)
could only change precision mid-run by rewriting accelerate's private state, which any accelerate upgrade may
break silently. So the Accelerator is created with mixed_precision "no" (it never wraps a forward and never owns a
scaler) and this object does, with public torch API only, what accelerate's mixed precision did for us:

- `autocast()`: the context every forward of the model runs in (accelerate wrapped the prepared modules' forward
  in one; here the call sites enter it: the training step, text encoding, validation loss, probes, sampling);
- `scale(loss)` before backward, `unscale_(optimizer)` before clipping, `step(optimizer)` = the scaler's step and
  update (accelerate's optimizer wrapper did that), and `skip()` when a guard skips the optimizer step;
- `state_dict()` for the checkpoint key `scaler`: the GradScaler's own state, the same as accelerate saved.

Differences from accelerate, and why they do not matter here:
- accelerate also cast the wrapped modules' outputs to fp32; every consumer of a UNet output here casts it to
  fp32 itself (loss.diffusion_loss; the LPIPS decode runs outside autocast in the VAE's dtype);
- on a CPU accelerate silently ran fp16 without autocast or scaler; here fp16 means fp16 autocast and loss scaling
  on every device (torch supports both on the CPU), so a CPU run behaves like a GPU run, only slower;
- with several processes each rank has its own scaler; the LoRA gradients are summed across ranks before
  `unscale_` (loop.sum_gradients_across_ranks), so every rank sees the same inf/NaN, takes the same decision
  and keeps the same scale, as accelerate's plain GradScaler under DDP did.
"""
from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any

import torch

from ..config import ConfigError

PRECISIONS = ("no", "fp16", "bf16")


def precision_dtype(precision: str) -> torch.dtype:
    """The torch dtype of a precision name as the config spells it: fp16, bf16, and fp32 or "no" (float32)."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)


class MixedPrecision:
    """Autocast and loss scaling for one run; `switch_to` changes precision in the middle of it."""

    def __init__(self, precision: str, device: torch.device | str) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"mixed precision {precision!r} is not one of {', '.join(PRECISIONS)}")
        self.device_type = torch.device(device).type
        self.precision = precision
        refused = unsupported(precision, self.device_type)
        if refused:  # accelerate refused these when it owned mixed precision; so do we, in one sentence
            raise ConfigError([refused])
        # Only fp16 needs a scaler: its 5-bit exponent underflows small gradients; bf16 has fp32's range.
        self.scaler: torch.amp.GradScaler | None = torch.amp.GradScaler(self.device_type) \
            if precision == "fp16" else None
        self._unscaled = False  # unscale_ ran since the scaler's last update (so skip() must update it)

    # ---- forward ---------------------------------------------------------------------------------------------
    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the frozen model runs in now (it changes with a fallback); LoRA weights stay fp32."""
        return precision_dtype(self.precision)

    def autocast(self) -> AbstractContextManager[Any]:
        """The context a forward of the model runs in: autocast to fp16/bf16, or nothing for fp32."""
        if self.precision == "no":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.weight_dtype)

    # ---- backward and the optimizer step ---------------------------------------------------------------------
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: multiplied by the loss scale under fp16, unchanged otherwise."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale in place, so clipping and the non-finite check see true values."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
            self._unscaled = True

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step; under fp16 the scaler skips it when a gradient overflowed, then adapts its scale."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()
        self._unscaled = False

    def skip(self) -> None:
        """A guard skipped the optimizer step: let the scaler learn from this step's gradients all the same (an
        overflow halves the scale), as its own step would have; it also readies the scaler for the next step."""
        if self.scaler is not None and self._unscaled:
            self.scaler.update()
            self._unscaled = False

    @property
    def loss_scale(self) -> float | None:
        """The current fp16 loss scale; None when no scaler runs (fp32, bf16, or after a fallback)."""
        return float(self.scaler.get_scale()) if self.scaler is not None else None

    # ---- the fallback ----------------------------------------------------------------------------------------
    def switch_to(self, precision: str) -> None:
        """Run the rest of the training in `precision` ('bf16' or 'no'): autocast follows and the scaler goes
        (neither needs loss scaling). The caller recasts the frozen weights (guards/precision.py)."""
        if precision not in ("no", "bf16"):
            raise ValueError(f"can only fall back to 'bf16' or 'no', not {precision!r}")
        self.precision = precision
        self.scaler = None
        self._unscaled = False

    def recast_frozen(self, modules: list[torch.nn.Module], trained: list[torch.nn.Parameter]) -> None:
        """Put the frozen weights and buffers of `modules` in `weight_dtype` (after `switch_to`); the `trained`
        LoRA weights stay fp32 and are not touched."""
        dtype, keep = self.weight_dtype, {id(p) for p in trained}
        for module in modules:
            for p in module.parameters():
                if id(p) not in keep and p.dtype != dtype:
                    p.data = p.data.to(dtype)
            for b in module.buffers():
                if b.is_floating_point():
                    b.data = b.data.to(dtype)

    # ---- checkpoints -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (the checkpoint's `scaler`), {} when there is none; the same dict accelerate's
        GradScaler saved, so checkpoints of either kind load into the other."""
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the scaler's state; an empty state (no scaler when saved) leaves a fresh scaler as it is, and a
        scaler state arriving after a fallback is not needed: the run no longer scales its loss."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def unsupported(precision: str, device_type: str) -> str | None:
    """Why `precision` cannot run on this device, or None when it can."""
    if precision == "no":
        return None
    if not torch.amp.is_autocast_available(device_type):
        return f"mixed_precision {precision} is not available on {device_type}; choose mixed_precision no."
    if precision == "bf16" and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        return ("mixed_precision bf16 needs a GPU with bf16 support (NVIDIA Ampere or newer), which this one is "
                "not; choose fp16 (or no).")
    return None
