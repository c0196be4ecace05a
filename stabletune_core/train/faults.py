"""Test-only fault injection, driven by the STABLETUNE_FAULTS environment variable.

    STABLETUNE_FAULTS="nan_loss@5,nan_grad@7,oom@3,disk_full@save:4,kill@step:6,kill@checkpoint:4"

    nan_loss@N          the loss (and so every gradient) of step N is NaN
    nan_grad@N          one LoRA gradient of step N is NaN, the loss stays finite
    oom@N               the first UNet forward of step N raises torch.cuda.OutOfMemoryError (list it twice
                        to fail twice)
    disk_full@save:N    writing the checkpoint of step N fails with ENOSPC half way through
    torch_full@save:N   the same, as the RuntimeError torch.save raises for a full disk
    kill@step:N         SIGKILL between the backward pass and the optimizer step of step N
    kill@checkpoint:N   SIGKILL half way through writing the checkpoint of step N

Steps count from 1 (step N is the N-th optimizer step). With the variable unset, `ACTIVE` is False and the
loop never calls into this module, so production runs pay one boolean test per step.
"""
from __future__ import annotations

import errno
import os
import signal
from collections import Counter
from typing import Any

import torch

KINDS = ("nan_loss", "nan_grad", "oom", "disk_full@save", "torch_full@save", "kill@step", "kill@checkpoint")


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


def corrupt_step(s: Any, loss: float) -> float:
    """After the backward pass of step `s.state.step + 1`: poison the loss or gradients, or die."""
    step = s.state.step + 1
    if take("kill@step", step):
        kill_self()
    if take("nan_loss", step):
        for p in s.params:
            if p.grad is not None:
                p.grad.fill_(float("nan"))
        return float("nan")
    if take("nan_grad", step):
        first = next(p for p in s.params if p.grad is not None)
        first.grad.view(-1)[0] = float("nan")
    return loss


def arm_oom(s: Any) -> None:
    """Make the UNet raise CUDA out-of-memory on the first forward of each step listed as oom@N."""
    unet = s.accelerator.unwrap_model(s.trained["unet"])

    def hook(module: torch.nn.Module, args: Any) -> None:
        if take("oom", s.state.step + 1):
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected by STABLETUNE_FAULTS at step "
                                              f"{s.state.step + 1}, micro-batch {s.state.micro_batch_size}).")

    unet.register_forward_pre_hook(hook)


def during_checkpoint_write(step: int) -> None:
    """Called by save_checkpoint after the first file is written and before the manifest."""
    if take("kill@checkpoint", step):
        kill_self()
    if take("disk_full@save", step):
        raise OSError(errno.ENOSPC, "No space left on device (injected by STABLETUNE_FAULTS)")
    if take("torch_full@save", step):
        raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0 (injected by "
                           "STABLETUNE_FAULTS): PytorchStreamWriter failed writing file data/0: file write failed")
