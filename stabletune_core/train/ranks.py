"""Everything that talks to the other processes of a multi-device run, in one place.

accelerate starts one process per device; each trains on its share of every global batch. Whatever several
processes must agree on goes through `Ranks`, with accelerate's public API: the step's loss and image counts
(summed, with a flag saying whether some rank ran out of memory), the LoRA gradients (summed in one all-reduce),
and the main process's decisions (a stop signal, a command from the UI) broadcast to all. With one process every
method is a plain local answer and nothing is sent anywhere.

Nothing here runs while a rank computes: each phase of a step ends in one collective, so a rank that failed
(out of memory) still meets the others there, and all of them take the same decision.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch
from accelerate import Accelerator

T = TypeVar("T")


class Ranks:
    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    # ---- who we are --------------------------------------------------------------------------------------------
    @property
    def count(self) -> int:
        return self.accelerator.num_processes

    @property
    def several(self) -> bool:
        return self.accelerator.num_processes > 1

    @property
    def index(self) -> int:
        return self.accelerator.process_index

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    @property
    def kind(self) -> str:
        """How the processes are wired (accelerate's distributed type, e.g. MULTI_GPU), for the run's events."""
        return str(self.accelerator.distributed_type)

    # ---- the trained modules -------------------------------------------------------------------------------------
    def prepare(self, *objects: Any) -> tuple[Any, ...]:
        """accelerate's wrappers around the trained modules and the optimizer (DDP with several processes)."""
        return tuple(self.accelerator.prepare(*objects))

    def unwrap(self, module: torch.nn.Module) -> torch.nn.Module:
        return self.accelerator.unwrap_model(module)

    @contextlib.contextmanager
    def no_sync(self, modules: Iterable[torch.nn.Module]) -> Iterator[None]:
        """No DDP hook fires inside: gradients are summed once, by `sum_gradients`, after every micro-batch."""
        with contextlib.ExitStack() as stack:
            for module in modules:
                stack.enter_context(self.accelerator.no_sync(module))
            yield

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    # ---- agreement --------------------------------------------------------------------------------------------------
    def agree(self, values: list[float | torch.Tensor], failure: str | None) -> torch.Tensor:
        """`values` summed over all ranks, in one all-reduce that also carries whether this rank ran out of memory.
        If any rank did, every rank raises the same out-of-memory error naming them, so the memory guard shrinks
        the micro-batch on every rank (or stops every rank) alike."""
        flags = [torch.as_tensor(float(failure is not None)), *(torch.as_tensor(v).float() for v in values)]
        summed = self.accelerator.reduce(torch.stack([f.to(self.device) for f in flags]), "sum")
        if summed[0] > 0:
            from accelerate.utils import gather_object

            reasons = [f"rank {rank}: {reason}" for rank, reason in enumerate(gather_object([failure])) if reason]
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory on {len(reasons)} of {self.count} processes "
                                              f"({'; '.join(reasons)}).")
        return summed[1:]

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum the LoRA gradients (text encoders' included) over ranks in one all-reduce; each rank already divided
        by the global image count, so the sum is the gradient of the global mean loss."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = self.accelerator.reduce(torch.cat([g.flatten() for g in grads]), "sum")
        for p, chunk in zip(params, flat.split([g.numel() for g in grads])):
            if p.grad is not None:
                p.grad.copy_(chunk.view_as(p.grad))

    def total(self, count: int) -> int:
        """`count` summed over ranks (images of a step: ranks may hold different counts when buckets end unevenly)."""
        if not self.several:
            return count
        return int(self.accelerator.reduce(torch.tensor(float(count), device=self.device), "sum"))

    def from_main(self, value: T) -> T:
        """The main process's `value` on every rank (a stop signal, a UI command): a rank deciding alone would
        leave the others waiting in the next collective."""
        if not self.several:
            return value
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([value])[0]

    def wait(self) -> None:
        """Every rank reaches this point before any goes on (around checkpoints and exports)."""
        self.accelerator.wait_for_everyone()
