"""Does a run folder hold an earlier run? Asked before a new run may write there (nothing is overwritten)."""
from __future__ import annotations

from ..config import ConfigError, TrainConfig
from .layout import RunPaths


def earlier_run(paths: RunPaths, config: TrainConfig) -> str:
    """What in the run folder shows that an earlier run trained there ("" when nothing does)."""
    if paths.checkpoint_folders():
        return "checkpoints"
    if paths.output.is_dir() and any(paths.output.iterdir()):
        return f"{paths.output.name}/{sorted(p.name for p in paths.output.iterdir())[0]}"
    if paths.metrics.is_file() and paths.metrics.stat().st_size:
        return paths.metrics.name
    if paths.samples.is_dir() and any(paths.samples.iterdir()):
        return paths.samples.name
    if paths.config.is_file():
        try:
            if TrainConfig.from_toml(paths.config) != config:
                return f"{paths.config.name} of another configuration"
        except (ConfigError, OSError, UnicodeDecodeError):  # not even a config of ours: someone else's file
            return paths.config.name
    return ""
