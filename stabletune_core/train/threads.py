"""How many threads a CPU run computes on, and the console line that says so (issue 24, item 8).

torch's default is one thread per core, which is wrong for a CPU run in two ways (bench/cpu_threads.py measures
both, side by side):

* a small model (the tiny test models, the toy bases: denoisers of a few million parameters) does operations too small
  to split: its step goes to dispatching kernels, and extra threads only add synchronisation;
* on a loaded machine, a thread whose core is busy stalls every parallel region (the others wait for it at each
  barrier): the seed's command took 1374 s with torch's two threads and 95 s with one on a loaded 2-core machine.

The rule, for a CPU run whose threads nobody chose:
  * a denoiser (UNet or transformer) under SMALL_DENOISER_PARAMETERS: one thread;
  * otherwise the idle cores: those this process may use minus the load the rest of the machine puts on them (the
    one-minute load average), at least one.
OMP_NUM_THREADS, when set (by the user, or by a launcher such as `accelerate launch`), is kept as torch read it.
A GPU run is left alone: its CPU threads only feed the GPU.
"""
from __future__ import annotations

import os

import torch

#: Below this many denoiser parameters a step is dispatch-bound on a CPU (the tiny SD1 and the toy base have 1.6 M,
#: SD 1.5's UNet has 860 M); bench/cpu_threads.py measures both sides.
SMALL_DENOISER_PARAMETERS = 50_000_000


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def denoiser_kind(denoiser: torch.nn.Module) -> str:
    """What the denoiser is, in a word a user knows: "UNet" (SD 1.x/2.x/XL), "transformer" (FLUX.2 Klein)."""
    name = type(denoiser).__name__
    return "UNet" if "UNet" in name else "transformer" if "Transformer" in name else "denoiser"


def choose_cpu_threads(denoiser_parameters: int, kind: str = "denoiser") -> tuple[int, str]:
    """(threads, why) for a CPU run: OMP_NUM_THREADS when set, else the rule above. `kind`: denoiser_kind's
    word for the model, for the sentence."""
    told = os.environ.get("OMP_NUM_THREADS", "").strip()
    if told:
        return torch.get_num_threads(), f"OMP_NUM_THREADS={told}"
    cores = usable_cores()
    if denoiser_parameters < SMALL_DENOISER_PARAMETERS:
        return 1, (f"a {kind} of {denoiser_parameters / 1e6:.1f} M parameters is dispatch-bound, more threads only add "
                   "synchronisation")
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    idle = max(1, min(cores, cores - round(load)))
    return idle, f"the idle cores: {cores} usable, 1-minute load average {load:.1f}"


def set_cpu_threads(denoiser: torch.nn.Module) -> tuple[int, str]:
    """Apply the rule to this process; returns (threads, the console sentence)."""
    threads, why = choose_cpu_threads(sum(p.numel() for p in denoiser.parameters()), denoiser_kind(denoiser))
    torch.set_num_threads(threads)
    plural = "thread" if threads == 1 else "threads"
    how = "" if why.startswith("OMP_NUM_THREADS") else "; set OMP_NUM_THREADS to choose another count"
    return threads, f"Training with {threads} CPU {plural} ({why}){how}."
