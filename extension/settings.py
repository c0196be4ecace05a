"""What the host (app.py, or a WebUI extension) tells the UI about its surroundings."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class UISettings:
    runs_dir: Path = Path("runs")
    # The interpreter that trains: it has torch and pydantic 2 even when the host (A1111) does not.
    engine_python: str = sys.executable
    # Folders searched for checkpoints and diffusers models (the model source picker).
    model_dirs: list[Path] = field(default_factory=list)
    presets_dir: Path = REPO_ROOT / "presets"
    # Seconds between live refreshes of status, plots and samples.
    refresh_seconds: float = 2.0
    num_processes: int = 1

    def __post_init__(self) -> None:
        self.runs_dir = Path(self.runs_dir).expanduser().resolve()
        self.model_dirs = [Path(p).expanduser() for p in self.model_dirs]
        self.presets_dir = Path(self.presets_dir)
