"""Names of everything under RUN/: the one place they are spelled. Engine and UI both import these (the event kinds
are in events.py), never spell paths themselves."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SPECTRA_FILE = "spectra.jsonl"  # RUN/diagnostics/: LoRA singular-value spectra (train/observers/diagnostics.py)
ACTIVATIONS_FILE = "activations.jsonl"  # LoRA output statistics on a fixed probe
VAL_LOSS_FILE = "val_loss.jsonl"  # validation loss and its noise bands
WARNINGS_FILE = "warnings.jsonl"  # diagnostics warnings
IMAGE_LOSSES_FILE = "image_losses.jsonl"  # per-image losses of each step (the doctor's ranking, runs/image_losses.py)
PERCEPTUAL_DRIFT_FILE = "perceptual_drift.jsonl"  # drift and concept distance per sampling (observers/perceptual_drift.py)

# RUN/samples/step_NNNNNN/ and RUN/checkpoints/step_NNNNNN/: one folder per step, named alike.
STEP_FOLDER_PATTERN = "step_*"
_STEP_FOLDER = re.compile(r"step_(\d+)")
SAMPLE_PROMPTS_FILE = "prompts.json"  # in a sampling folder: {"prompts": [...], "seeds": [...]} of its images
# In a checkpoint folder (train/checkpoint.py): the adapter weights, the rest of the state, the sha256 of each.
CHECKPOINT_ADAPTER = "adapter.safetensors"
CHECKPOINT_STATE = "state.pt"
CHECKPOINT_MANIFEST = "manifest.json"
LORA_SUFFIX = ".safetensors"
_SAMPLE_IMAGE = re.compile(r"p(\d+)_s(-?\d+)")
_TEMPORARY_KINDS = ("tmp", "old")
_TEMPORARY = re.compile(r"\.(\w+?)_step_\d+_(\d+)")


def step_folder_name(step: int) -> str:
    """step_NNNNNN: a sampling's or a checkpoint's folder name."""
    return f"step_{step:06d}"


def step_of(folder: Path | str) -> int | None:
    """The step a step_NNNNNN folder (or name) is of; None for any other name."""
    match = _STEP_FOLDER.fullmatch(Path(folder).name)
    return int(match.group(1)) if match else None


def step_folders(parent: Path) -> list[Path]:
    """The step_NNNNNN folders in `parent`, oldest step first (none when `parent` is missing)."""
    if not Path(parent).is_dir():
        return []
    return sorted((p for p in Path(parent).glob(STEP_FOLDER_PATTERN) if p.is_dir() and step_of(p) is not None),
                  key=lambda p: step_of(p))


def sample_image_name(prompt_index: int, seed: int) -> str:
    """A validation image's file name: the prompt's place in validation_prompt and the seed (p00_s42.png)."""
    return f"p{prompt_index:02d}_s{seed}.png"


def sample_image_place(stem: str) -> tuple[int, int] | None:
    """(prompt index, seed) of a validation image's file stem (p00_s42), None for any other name."""
    match = _SAMPLE_IMAGE.fullmatch(stem)
    return (int(match.group(1)), int(match.group(2))) if match else None


def run_of_sampling(folder: Path) -> Path:
    """The run folder a sampling folder (RUN/samples/step_NNNNNN) belongs to."""
    return Path(folder).parent.parent


def sample_prompts(folder: Path) -> Path:
    """A sampling folder's prompts.json: the prompts and seeds of its images."""
    return Path(folder) / SAMPLE_PROMPTS_FILE


def checkpoint_manifest(folder: Path) -> Path:
    """A checkpoint's manifest.json: the sha256 of each of its files, checked before a resume uses it."""
    return Path(folder) / CHECKPOINT_MANIFEST


def checkpoint_adapter(folder: Path) -> Path:
    """A checkpoint's adapter.safetensors: the trained weights (and pivotal tuning's new rows)."""
    return Path(folder) / CHECKPOINT_ADAPTER


def checkpoint_state(folder: Path) -> Path:
    """A checkpoint's state.pt: optimizer, scheduler, scaler, EMA, RNG and data position (tensors and plain
    values only, loaded with weights_only)."""
    return Path(folder) / CHECKPOINT_STATE


def checkpoint_temporary(folder: Path, kind: str, pid: int) -> Path:
    """Where a checkpoint is written before its rename (kind "tmp") or an older one at the same step waits to be
    deleted ("old"): .KIND_step_NNNNNN_PID beside it, so a dead process's leftovers can be told from a live one's."""
    if kind not in _TEMPORARY_KINDS:
        raise ValueError(f"{kind!r} is not a checkpoint temporary kind ({', '.join(_TEMPORARY_KINDS)}).")
    return Path(folder).parent / f".{kind}_{Path(folder).name}_{pid}"


def checkpoint_temporaries(parent: Path) -> list[tuple[Path, int]]:
    """The checkpoint temporaries in `parent` with the process id that wrote each."""
    found = []
    for path in Path(parent).glob(".*_step_*") if Path(parent).is_dir() else []:
        match = _TEMPORARY.fullmatch(path.name)
        if match and match.group(1) in _TEMPORARY_KINDS:
            found.append((path, int(match.group(2))))
    return found


def ema_name(name: str) -> str:
    """The LoRA of the moving average beside NAME (ema_decay): NAME-ema."""
    return f"{name}-ema"


def best_name(name: str) -> str:
    """The best checkpoint's LoRA (early stopping): NAME_best."""
    return f"{name}_best"


def forge_name(name: str) -> str:
    """The LoRA without its bundled words, for Forge (pivotal tuning with more words than Forge accepts):
    NAME_forge."""
    return f"{name}_forge"


def embeddings_name(name: str) -> str:
    """The folder of pivotal tuning's new tokens beside NAME: NAME_embeddings."""
    return f"{name}_embeddings"


def step_lora_name(name: str, step: int) -> str:
    """A LoRA of one step: NAME_stepNNNNNN (`export` of a checkpoint)."""
    return f"{name}_step{step:06d}"


def set_aside_name(name: str, step: int | None) -> str:
    """A LoRA of an earlier part of the run, moved aside so it cannot pass for the current one: NAME_stepNNNNNN
    (NAME_earlier when its step is unknown)."""
    return step_lora_name(name, step) if step is not None else f"{name}_earlier"


@dataclass(frozen=True)
class RunPaths:
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Path:
        """The frozen, fully resolved config of the run (what `--config` resumes from)."""
        return self.root / "config.toml"

    @property
    def status(self) -> Path:
        """The heartbeat: state, step, pid, ETA and the last error, replaced whole (runs/states.py names the states)."""
        return self.root / "status.json"

    @property
    def metrics(self) -> Path:
        """One JSON object per logged step: loss, learning rate, gradient norm, memory, seconds a step."""
        return self.root / "metrics.jsonl"

    @property
    def events(self) -> Path:
        """What the guards did and why, one JSON object a line (runs/events.py names the kinds)."""
        return self.root / "events.jsonl"

    @property
    def control(self) -> Path:
        """The UI's commands to the engine: stop, save now, sample now, pause, resume (runs/states.py)."""
        return self.root / "control.json"

    @property
    def samples(self) -> Path:
        """Validation images, one step_NNNNNN folder per sampling, the same prompts and seeds each time."""
        return self.root / "samples"

    @property
    def diagnostics(self) -> Path:
        """The observers' records: spectra, activation statistics, validation loss, warnings, per-image losses."""
        return self.root / "diagnostics"

    @property
    def checkpoints(self) -> Path:
        """One step_NNNNNN folder per checkpoint: adapter, optimizer and RNG state, manifest with sha256."""
        return self.root / "checkpoints"

    @property
    def output(self) -> Path:
        """The LoRA files the run exports (and their EMA, best, Forge, diffusers and embedding companions)."""
        return self.root / "output"

    @property
    def cache(self) -> Path:
        """This run's own caches (cache_latents_to_disk: its text embeddings)."""
        return self.root / "cache"

    @property
    def tensorboard(self) -> Path:
        """TensorBoard event files (report_to tensorboard)."""
        return self.root / "tensorboard"

    @property
    def grids(self) -> Path:
        """Checkpoint comparison grids (stabletune_core/grid.py): NAME.png, its progress NAME.json, its NAME.log."""
        return self.root / "grids"

    def grid_cancel(self, name: str) -> Path:
        """RUN/grids/NAME.cancel: the UI's Cancel of grid NAME (the grid looks for it before each image)."""
        return self.grids / f"{name}.cancel"

    @property
    def gallery(self) -> Path:
        """The demo's one-picture summary of the validation images (demo.py make_gallery)."""
        return self.root / "gallery.png"

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
        """LoRA singular-value spectra over the run."""
        return self.diagnostics / SPECTRA_FILE

    @property
    def activations(self) -> Path:
        """LoRA output statistics on a fixed probe."""
        return self.diagnostics / ACTIVATIONS_FILE

    @property
    def val_loss(self) -> Path:
        """The deterministic validation loss and its noise bands."""
        return self.diagnostics / VAL_LOSS_FILE

    @property
    def warnings(self) -> Path:
        """The diagnostics' warnings (rank collapse, exploding activations, ...)."""
        return self.diagnostics / WARNINGS_FILE

    @property
    def image_losses(self) -> Path:
        """Per-image losses of each step: the doctor's ranking of images the LoRA cannot fit."""
        return self.diagnostics / IMAGE_LOSSES_FILE

    @property
    def perceptual_drift(self) -> Path:
        """Each sampling's drift of every prompt from the base's step-0 image and each concept prompt's distance to
        the training images (a judge for any run, charted by the Samples tab).

        Same prompt and seed for the drift; the nearest training image for the concept; in LPIPS where its weights
        are on the machine, else in the model's own VAE latents (train/observers/perceptual_drift.py)."""
        return self.diagnostics / PERCEPTUAL_DRIFT_FILE

    @property
    def artefacts(self) -> tuple[Path, ...]:
        """What a run leaves in RUN/ (moved aside together by --overwrite_output_dir); train.log stays: the UI's
        launcher holds it open for the next run."""
        return (self.config, self.status, self.metrics, self.events, self.control, self.samples, self.diagnostics,
                self.checkpoints, self.output, self.cache, self.tensorboard, self.grids, self.traceback)

    def checkpoint(self, step: int) -> Path:
        """RUN/checkpoints/step_NNNNNN: the checkpoint of one step."""
        return self.checkpoints / step_folder_name(step)

    def sample_dir(self, step: int) -> Path:
        """RUN/samples/step_NNNNNN: the validation images of one sampling, with its prompts.json."""
        return self.samples / step_folder_name(step)

    def sample_image(self, step: int, prompt_index: int, seed: int) -> Path:
        """One validation image: pPROMPT_sSEED.png in its sampling's folder."""
        return self.sample_dir(step) / sample_image_name(prompt_index, seed)

    def checkpoint_folders(self) -> list[Path]:
        """RUN/checkpoints/step_NNNNNN folders, finished or not, oldest first."""
        return step_folders(self.checkpoints)

    def sample_folders(self) -> list[Path]:
        """RUN/samples/step_NNNNNN folders whose sampling wrote its prompts.json, oldest first."""
        return [p for p in step_folders(self.samples) if sample_prompts(p).is_file()]

    def lora(self, name: str) -> Path:
        """RUN/output/NAME.safetensors: a LoRA this run exports (NAME: output_name, or its ema_name / best_name)."""
        return self.output / f"{name}{LORA_SUFFIX}"

    def diffusers_lora(self, name: str) -> Path:
        """RUN/output/NAME_diffusers/: the same LoRA in diffusers' layout (export_diffusers_format)."""
        return self.output / f"{name}_diffusers"

    def embeddings(self, name: str) -> Path:
        """RUN/output/NAME_embeddings/: pivotal tuning's new tokens, one embedding file each."""
        return self.output / embeddings_name(name)

    def loras(self) -> list[Path]:
        """Every LoRA file in RUN/output, oldest first."""
        if not self.output.is_dir():
            return []
        return sorted(self.output.glob(f"*{LORA_SUFFIX}"), key=lambda p: p.stat().st_mtime)

    def aside(self, stamp: str) -> Path:
        """Where --overwrite_output_dir moves an earlier run: RUN/previous-<stamp>."""
        return self.root / f"previous-{stamp}"


def run_folder_map() -> list[str]:
    """The run folder as docs/ARCHITECTURE.md shows it, one line a name: RUN/... and the first sentence of what
    RunPaths says it holds (the listings and helpers that name no new place are left out)."""
    import inspect

    paths = RunPaths(Path("RUN"))
    examples = {"step": 100, "name": "NAME", "prompt_index": 0, "seed": 1000, "stamp": "STAMP"}
    places = []
    for attribute, member in vars(RunPaths).items():
        if attribute.startswith("_") or attribute in ("artefacts", "loras", "checkpoint_folders", "sample_folders"):
            continue
        getter = member.fget if isinstance(member, property) else member
        if callable(getter):
            arguments = [examples[p] for p in list(inspect.signature(getter).parameters)[1:]]
            places.append((getter(paths, *arguments), getter))
    step_checkpoint, sampling = paths.checkpoint(100), paths.sample_dir(100)
    places += [(helper(step_checkpoint), helper) for helper in (checkpoint_adapter, checkpoint_state,
                                                                checkpoint_manifest)]
    places.append((sample_prompts(sampling), sample_prompts))
    rows = []
    for where, getter in sorted(places, key=lambda place: place[0].parts):
        doc = (inspect.getdoc(getter) or "").split("\n\n")[0].replace("\n", " ")
        doc = doc.split(": ", 1)[1] if doc.startswith(("RUN/", "A checkpoint's", "A sampling")) and ": " in doc \
            else doc
        rows.append(f"{where.as_posix()}{'/' if not where.suffix else ''}  {doc[:1].upper()}{doc[1:]}")
    return rows
