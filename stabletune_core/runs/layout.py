"""Names of everything under RUN/: the one place they are spelled. Engine and UI both import these (the event kinds
are in events.py), never spell paths themselves."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SPECTRA_FILE = "spectra.jsonl"  # RUN/diagnostics/: LoRA singular-value spectra (train/observers/diagnostics.py)
ACTIVATIONS_FILE = "activations.jsonl"  # LoRA output statistics on a fixed probe
VAL_LOSS_FILE = "val_loss.jsonl"  # validation loss and its noise bands
WARNINGS_FILE = "warnings.jsonl"  # diagnostics warnings
IMAGE_LOSSES_FILE = "image_losses.jsonl"  # per-image losses of each step (the doctor's ranking, tools/image_losses.py)


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
    def cache(self) -> Path:
        """This run's own caches (cache_latents_to_disk: its text embeddings)."""
        return self.root / "cache"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def grids(self) -> Path:
        """Checkpoint comparison grids (stabletune_core/grid.py): NAME.png, its progress NAME.json, its NAME.log."""
        return self.root / "grids"

    def grid_cancel(self, name: str) -> Path:
        """RUN/grids/NAME.cancel: the UI's Cancel of grid NAME (the grid looks for it before each image)."""
        return self.grids / f"{name}.cancel"

    @property
    def log(self) -> Path:
        """The engine's console output, as the UI's launcher writes it (it holds the file open for the run)."""
        return self.root / "train.log"

    @property
    def traceback(self) -> Path:
        """An internal error's traceback (the console gets one sentence naming this file)."""
        return self.root / "traceback.txt"

    @property
    def spectra(self) -> Path:
        return self.diagnostics / SPECTRA_FILE

    @property
    def activations(self) -> Path:
        return self.diagnostics / ACTIVATIONS_FILE

    @property
    def val_loss(self) -> Path:
        return self.diagnostics / VAL_LOSS_FILE

    @property
    def warnings(self) -> Path:
        return self.diagnostics / WARNINGS_FILE

    @property
    def image_losses(self) -> Path:
        return self.diagnostics / IMAGE_LOSSES_FILE

    @property
    def artefacts(self) -> tuple[Path, ...]:
        """What a run leaves in RUN/ (moved aside together by --overwrite_output_dir); train.log stays: the UI's
        launcher holds it open for the next run."""
        return (self.config, self.status, self.metrics, self.events, self.control, self.samples, self.diagnostics,
                self.checkpoints, self.output, self.cache, self.tensorboard, self.grids, self.traceback)

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step:06d}"

    def sample_dir(self, step: int) -> Path:
        return self.samples / f"step_{step:06d}"

    def aside(self, stamp: str) -> Path:
        """Where --overwrite_output_dir moves an earlier run: RUN/previous-<stamp>."""
        return self.root / f"previous-{stamp}"
