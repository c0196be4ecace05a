"""Run a trainer (a module with -m, or a script) and note when each optimizer step ends, for bench/first_step.py.

    python bench/step_probe.py TIMES.txt -m stabletune_core train ...
    python bench/step_probe.py TIMES.txt /tmp/peer/train_text_to_image_lora.py ...

A global optimizer step hook (torch.optim.optimizer.register_optimizer_step_post_hook) appends
"step wall-time peak-RSS-MiB peak-CUDA-MiB" to TIMES.txt after every optimizer step, whatever trainer runs: both
trainers are timed and weighed by the same clock at the same point, without changing either. Peak RSS is this
process's high-water mark so far (getrusage; the trainer runs in this process), peak CUDA memory is
torch.cuda.max_memory_allocated (0 when CUDA is not in use). Importing torch here first costs nothing extra: the
trainer imports it too.
"""
from __future__ import annotations

import resource
import runpy
import sys
import time


def main() -> None:
    times_file, target, *rest = sys.argv[1:]
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    out = open(times_file, "a", buffering=1)
    count = [0]

    def after_step(optimizer, args, kwargs) -> None:
        count[0] += 1
        now = time.time()
        rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        cuda_mib = torch.cuda.max_memory_allocated() / 2 ** 20 if torch.cuda.is_initialized() else 0.0
        out.write(f"{count[0]} {now:.4f} {rss_mib:.1f} {cuda_mib:.1f}\n")

    register_optimizer_step_post_hook(after_step)
    if target == "-m":
        module, *args = rest
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *rest]
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
