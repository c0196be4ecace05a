"""`report_to = tensorboard`: the loop's metrics and validation images as TensorBoard event files.

An observer: the loop hands it the metrics it already logs (and the paths of the validation images it
made); it only writes under RUN/tensorboard and never decides anything. Open the files with
`tensorboard --logdir RUN/tensorboard`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import TrainConfig

TENSORBOARD_PIN = "tensorboard==2.21.0"
# The metrics of a step, by TensorBoard tag; anything else numeric goes under train/.
TAGS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
        "clip_threshold": "train/clip_threshold", "sec_per_step": "train/sec_per_step",
        "micro_batch_size": "train/micro_batch_size", "images_seen": "train/images_seen", "epoch": "train/epoch",
        "val_loss": "validation/loss", "ram_mb": "memory/ram_mb", "vram_allocated_mb": "memory/vram_allocated_mb",
        "vram_reserved_mb": "memory/vram_reserved_mb", "vram_peak_mb": "memory/vram_peak_mb"}


class TensorBoardLog:
    """Writes scalars and images into `folder` with torch's SummaryWriter."""

    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.folder = folder
        self.writer = SummaryWriter(log_dir=str(folder), flush_secs=10)

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        for name, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # None (e.g. no clip threshold yet) and flags are not curves
            self.writer.add_scalar(TAGS.get(name, f"train/{name}"), float(value), step)

    def log_images(self, step: int, paths: list[Path]) -> None:
        import numpy as np
        from PIL import Image

        for path in paths:
            with Image.open(path) as image:
                pixels = np.asarray(image.convert("RGB"))
            self.writer.add_image(f"samples/{Path(path).stem}", pixels, step, dataformats="HWC")
        self.writer.flush()  # samples are rare and what a user opens TensorBoard to see

    def close(self) -> None:
        self.writer.close()


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def make_tensorboard_log(config: TrainConfig, run_root: Path) -> tuple[TensorBoardLog | None, str | None]:
    """(the log, None) when the config asks for TensorBoard and it is installed; otherwise (None, a sentence
    for the user, or None when nothing was asked)."""
    if config.report_to == "jsonl":
        return None, None
    if config.report_to != "tensorboard":
        return None, (f"report_to={config.report_to} is not supported; this run writes its metrics to "
                      "metrics.jsonl only (report_to=tensorboard writes TensorBoard event files).")
    if not tensorboard_available():
        return None, (f"report_to=tensorboard needs the tensorboard package (pip install {TENSORBOARD_PIN}); "
                      "this run writes its metrics to metrics.jsonl only.")
    return TensorBoardLog(run_root / "tensorboard"), None
