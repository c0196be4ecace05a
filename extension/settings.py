"""What the host (app.py, or a WebUI extension) tells the UI about its surroundings."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class UISettings:
    runs_dir: Path = Path("runs")
    # The interpreter that trains: it has torch and pydantic 2 even when the host (A1111) does not.
    engine_python: str = sys.executable
    # Folders searched for checkpoints and diffusers models (the model source picker).
    model_dirs: list[Path] = field(default_factory=list)
    presets_dir: Path = REPO_ROOT / "presets"  # shipped with StableTune: read only
    # Where "Save preset" writes (never into the repository, which an update would overwrite).
    user_presets_dir: Path = Path(os.environ.get("STABLETUNE_PRESETS", "~/.config/stabletune/presets"))
    # Seconds between live refreshes of status, plots and samples.
    refresh_seconds: float = 2.0
    num_processes: int = 1
    # Host hooks (the WebUI tab sets them; the standalone app needs none). `before_start` runs right before
    # the engine is spawned on `run_dir` (a WebUI unloads its checkpoint to free VRAM) and returns a sentence
    # for the user or None; `run_note(run_dir)` adds a line to the run's status (e.g. where its LoRA was copied).
    before_start: Optional[Callable[[Path], Optional[str]]] = None
    run_note: Optional[Callable[[Path], Optional[str]]] = None

    def __post_init__(self) -> None:
        self.runs_dir = Path(self.runs_dir).expanduser().resolve()
        self.model_dirs = [Path(p).expanduser() for p in self.model_dirs]
        self.presets_dir = Path(self.presets_dir)
        self.user_presets_dir = Path(self.user_presets_dir).expanduser()

    @property
    def preset_folders(self) -> list[Path]:
        return [self.user_presets_dir, self.presets_dir]
