"""Test-only fault injection, driven by the STABLETUNE_FAULTS environment variable.

    STABLETUNE_FAULTS="nan_loss@5,nan_grad@7,oom@3,disk_full@save:4,kill@step:6,kill@checkpoint:4"

    nan_loss@N          the UNet's prediction in step N is NaN, so the loss and every gradient are
    nan_grad@N          one LoRA gradient of step N is NaN, the loss stays finite
    fp16_overflow@N     the backward pass of step N overflows in fp16 (the UNet output's gradient is inf), as
                        too high a loss scale makes it; only while the UNet runs in fp16
    oom@N               the first UNet forward of step N raises torch.cuda.OutOfMemoryError (list it twice
                        to fail twice)
    disk_full@save:N    writing the checkpoint of step N fails with ENOSPC half way through
    torch_full@save:N   the same, as the RuntimeError torch.save raises for a full disk
    kill@step:N         SIGKILL between the backward pass and the optimizer step of step N
    kill@checkpoint:N   SIGKILL half way through writing the checkpoint of step N

Steps count from 1 (step N is the N-th optimizer step). The faults reach a run through hooks that `arm`
installs on a freshly set-up session (a forward pre-hook and a forward hook on the UNet, a gradient hook on one
LoRA tensor, an optimizer step pre-hook, the checkpoint writer's `halfway` callback), so the loop and the
checkpoint writer hold no fault branch: a run without STABLETUNE_FAULTS installs nothing.
"""
from __future__ import annotations

import errno
import os
import signal
from collections import Counter
from typing import Any, Callable

import torch

from .checkpoint import nothing
from .train_state import TrainState

KINDS = ("nan_loss", "nan_grad", "fp16_overflow", "oom", "disk_full@save", "torch_full@save", "kill@step",
         "kill@checkpoint")


def parse(spec: str | None) -> Counter:
    """{(kind, step): times} from the variable's text; a typo is an error, not a silently ignored fault."""
    faults: Counter = Counter()
    for item in (spec or "").replace(" ", "").split(","):
        if not item:
            continue
        kind, _, step = item.rpartition(":" if ":" in item else "@")
        if kind not in KINDS or not step.isdigit():
            known = ", ".join(k + (":N" if "@" in k else "@N") for k in KINDS)
            raise ValueError(f"STABLETUNE_FAULTS entry {item!r} is not one of {known}.")
        faults[(kind, int(step))] += 1
    return faults


FAULTS: Counter = parse(os.environ.get("STABLETUNE_FAULTS"))
ACTIVE = bool(FAULTS)


def install(spec: str | None) -> None:
    """Set the faults of this process (for in-process tests; subprocesses read the variable)."""
    global FAULTS, ACTIVE
    FAULTS = parse(spec)
    ACTIVE = bool(FAULTS)


def take(kind: str, step: int) -> bool:
    """True once per listed occurrence of (kind, step)."""
    if FAULTS.get((kind, step), 0) <= 0:
        return False
    FAULTS[(kind, step)] -= 1
    return True


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(denoiser: torch.nn.Module, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
        state: TrainState) -> Callable[[int], None]:
    """Install this process's faults on a freshly set-up run (setup calls it last) and return the checkpoint
    writer's `halfway` callback; nothing at all (and `nothing`) when none are listed. `denoiser` is unwrapped.

    Only forward passes that build a graph count as the step's: validation loss, the diagnostics probe and
    sampling run without gradients between steps and must not take a fault meant for the next step.
    """
    if not ACTIVE:
        return nothing
    unet = denoiser

    def next_step() -> int:
        return state.step + 1

    def before_forward(module: torch.nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and take("oom", next_step()):
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected by STABLETUNE_FAULTS at step "
                                              f"{next_step()}, micro-batch {state.micro_batch_size}).")

    def after_forward(module: torch.nn.Module, args: Any, output: Any) -> Any:
        sample = output[0] if isinstance(output, tuple) else getattr(output, "sample", output)
        per_image = isinstance(sample, list)  # Z-Image's transformer returns one tensor per image
        sample = sample[0] if per_image else sample
        # whether fp16 overflows by itself depends on the CPU's fp16 kernels (a rate of 1.0 overflowed from step 2
        # where the fallback test was written, not on an AMD EPYC without AVX-512), so the tests overflow it here
        if (torch.is_grad_enabled() and sample.requires_grad and sample.dtype == torch.float16
                and take("fp16_overflow", next_step())):
            sample.register_hook(lambda grad: torch.full_like(grad, float("inf")))
        if not (torch.is_grad_enabled() and take("nan_loss", next_step())):
            return None
        if isinstance(output, tuple):
            poisoned = [x * float("nan") for x in output[0]] if per_image else output[0] * float("nan")
            return (poisoned, *output[1:])
        output.sample = output.sample * float("nan")
        return output

    unet.register_forward_pre_hook(before_forward)
    unet.register_forward_hook(after_forward)

    first = next(p for p in params if p.requires_grad)

    def poison_gradient(grad: torch.Tensor) -> torch.Tensor:
        if not take("nan_grad", next_step()):
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad

    first.register_hook(poison_gradient)

    def before_optimizer_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if take("kill@step", next_step()):
            kill_self()

    getattr(optimizer, "optimizer", optimizer).register_step_pre_hook(before_optimizer_step)
    return during_checkpoint_write


def during_checkpoint_write(step: int) -> None:
    """The checkpoint writer's `halfway` callback: after the first file, before the manifest."""
    if take("kill@checkpoint", step):
        kill_self()
    if take("disk_full@save", step):
        raise OSError(errno.ENOSPC, "No space left on device (injected by STABLETUNE_FAULTS)")
    if take("torch_full@save", step):
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0 (injected by "
                           "STABLETUNE_FAULTS): PytorchStreamWriter failed writing file data/0: file write failed")
