"""`report_to = tensorboard`: the loop's metrics and validation images as TensorBoard event files.

An ordinary observer (observers/base.py): it gets each metrics line the loop logs and the validation images it makes,
writes them under RUN/tensorboard and never decides anything. Open the files with
`tensorboard --logdir RUN/tensorboard`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ...config import TrainConfig
from ...runs.layout import RunPaths
from .base import NOTHING, Observation, Observer, ObserverView

TENSORBOARD_PIN = "tensorboard==2.21.0"
# The metrics of a step, by TensorBoard tag; anything else numeric goes under train/.
TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
        "clip_threshold": "train/clip_threshold", "sec_per_step": "train/sec_per_step",
        "micro_batch_size": "train/micro_batch_size", "images_seen": "train/images_seen", "epoch": "train/epoch",
        "val_loss": "validation/loss", "val_loss_low_noise": "validation/loss_low_noise",
        "val_loss_mid_noise": "validation/loss_mid_noise", "val_loss_high_noise": "validation/loss_high_noise",
        "ram_mb": "memory/ram_mb", "vram_allocated_mb": "memory/vram_allocated_mb",
        "vram_reserved_mb": "memory/vram_reserved_mb", "vram_peak_mb": "memory/vram_peak_mb"}


class TensorBoardLog(Observer):
    """Writes scalars and images into `folder` with torch's SummaryWriter."""

    name = "tensorboard"

    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.folder = folder
        self.writer = SummaryWriter(log_dir=str(folder), flush_secs=10)

    def on_metrics(self, view: ObserverView, metrics: Mapping[str, Any]) -> Observation:
        for name, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # None (e.g. no clip threshold yet) and flags are not curves
            self.writer.add_scalar(TAGS.get(name, f"train/{name}"), float(value), view.step)
        return NOTHING

    def on_samples(self, view: ObserverView, folder: Path, paths: list[Path]) -> Observation:
        import numpy as np
        from PIL import Image

        for path in paths:
            with Image.open(path) as image:
                pixels = np.asarray(image.convert("RGB"))
            self.writer.add_image(f"samples/{Path(path).stem}", pixels, view.step, dataformats="HWC")
        self.writer.flush()  # samples are rare and what a user opens TensorBoard to see
        return NOTHING

    def on_end(self, view: ObserverView) -> Observation:
        self.writer.close()
        return NOTHING


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def make_tensorboard_log(config: TrainConfig, paths: RunPaths) -> tuple[TensorBoardLog | None, str | None]:
    """(the log, None) when the config asks for TensorBoard and it is installed; otherwise (None, a sentence
    for the user, or None when nothing was asked)."""
    if config.report_to != "tensorboard":
        return None, None
    if not tensorboard_available():
        return None, (f"report_to=tensorboard needs the tensorboard package (pip install {TENSORBOARD_PIN}); "
                      "this run writes its metrics to metrics.jsonl only.")
    return TensorBoardLog(paths.tensorboard), None
