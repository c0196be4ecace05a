"""Memory numbers for the metrics: VRAM on a GPU, resident memory of the process always."""
from __future__ import annotations

import psutil
import torch

MB = 2**20


_THIS_PROCESS = psutil.Process()


def memory_stats(device: torch.device) -> dict[str, float]:
    stats = {"ram_mb": _THIS_PROCESS.memory_info().rss / MB}
    if device.type == "cuda":
        stats.update(vram_allocated_mb=torch.cuda.memory_allocated(device) / MB,
                     vram_reserved_mb=torch.cuda.memory_reserved(device) / MB,
                     vram_peak_mb=torch.cuda.max_memory_allocated(device) / MB)
    return stats
