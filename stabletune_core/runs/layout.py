"""Names of everything under RUN/. Engine and UI both import these, never spell paths themselves."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunPaths:
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Path:
        return self.root / "config.toml"

    @property
    def status(self) -> Path:
        return self.root / "status.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def control(self) -> Path:
        return self.root / "control.json"

    @property
    def samples(self) -> Path:
        return self.root / "samples"

    @property
    def diagnostics(self) -> Path:
        return self.root / "diagnostics"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def output(self) -> Path:
        return self.root / "output"

    @property
    def log(self) -> Path:
        return self.root / "train.log"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step:06d}"

    def sample_dir(self, step: int) -> Path:
        return self.samples / f"step_{step:06d}"
