"""An exponential moving average of the adapter weights (`ema_decay`).

An average of the recent weights is smoother than the weights at the last step: it forgets the last few
noisy updates of a small dataset. We keep a shadow copy of the trainable LoRA tensors, blend it after every
optimizer step that changed them, save it in checkpoints (so resume stays exact), and swap it in for
exporting `NAME-ema.safetensors` and, by choice, for validation images.

The decay warms up as diffusers' EMAModel does, min(decay, (1 + n) / (10 + n)) after n updates, so that a
short run's average is not dominated by the untrained start.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch


class AdapterEMA:
    def __init__(self, params: list[torch.nn.Parameter], decay: float, *, on_cpu: bool = False):
        self.params = params
        self.decay = decay
        self.device = torch.device("cpu") if on_cpu else None  # None: beside each parameter
        self.shadow = [p.detach().to(self.device or p.device, dtype=torch.float32, copy=True) for p in params]
        self.updates = 0

    def restart(self) -> None:
        """Average from the current weights on (a resumed checkpoint made without an EMA)."""
        self.shadow = [p.detach().to(self.device or p.device, dtype=torch.float32, copy=True) for p in self.params]
        self.updates = 0

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self) -> None:
        """Blend the current weights in; called once after each optimizer step that changed them."""
        decay = self.current_decay()
        for average, param in zip(self.shadow, self.params):
            average.lerp_(param.detach().to(average.device, torch.float32), 1.0 - decay)
        self.updates += 1

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Inside, the parameters hold the average; afterwards the trained weights are put back bit for bit."""
        saved = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for param, average in zip(self.params, self.shadow):
                param.copy_(average.to(param.device, param.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for param, copy in zip(self.params, saved):
                    param.copy_(copy)

    def state_dict(self) -> dict[str, Any]:
        """A copy (not a view of the live average, which keeps moving; `.cpu()` alone would alias it on a CPU)."""
        return {"shadow": [t.detach().to("cpu", copy=True) for t in self.shadow], "updates": self.updates,
                "decay": self.decay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["shadow"]) != len(self.shadow):
            raise ValueError(f"the checkpoint's EMA holds {len(state['shadow'])} tensors but this run trains "
                             f"{len(self.shadow)}; resume with the same LoRA settings")
        for average, saved in zip(self.shadow, state["shadow"]):
            average.copy_(saved.to(average.device, torch.float32))
        self.updates = int(state["updates"])


@contextmanager
def optional_swap(ema: AdapterEMA | None, wanted: bool = True) -> Iterator[None]:
    """`ema.swapped_in()` when there is an EMA and it is wanted here; otherwise nothing."""
    if ema is None or not wanted:
        yield
        return
    with ema.swapped_in():
        yield
