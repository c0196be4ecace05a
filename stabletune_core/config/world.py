"""Checks of the world outside the config (folders, files, disk), one sentence each, before any model loads."""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from .files import TrainConfig


def _reg_dir_problems(config: TrainConfig, data: Path | None) -> list[str]:
    """reg_data_dir must be a folder of its own: one folder inside the other would train its images twice (as
    instance and as class images)."""
    if not config.reg_data_dir:
        return []
    reg = Path(config.reg_data_dir).expanduser()
    if not reg.exists():
        return [f"Regularisation folder {reg} does not exist; choose the folder of class images or leave "
                "reg_data_dir empty."]
    if not reg.is_dir():
        return [f"Regularisation path {reg} is a file, not a folder; choose the folder of class images."]
    if data is not None and data.is_dir() and reg.resolve().is_relative_to(data.resolve()):
        return [f"Regularisation folder {reg} is inside the training folder (or is it), so its images would also "
                "train as instance images; move the class images to a folder of their own."]
    if data is not None and data.is_dir() and data.resolve().is_relative_to(reg.resolve()):
        return [f"Training folder {data} is inside the regularisation folder (reg_data_dir), so its images would "
                "also train as class images; move the training images to a folder of their own."]
    return []


def check_inputs(config: TrainConfig, *, need_model: bool = True) -> list[str]:
    """Problems with the world outside the config (folders, files, disk), one sentence each.

    Runs before any model loads so bad input costs no GPU time.
    """
    problems = []
    data = Path(config.train_data_dir).expanduser() if config.train_data_dir else None
    if data is None:
        problems.append("train_data_dir is empty; choose the folder that holds your training images.")
    elif not data.exists():
        problems.append(f"Dataset folder {data} does not exist; choose the folder that holds your images.")
    elif not data.is_dir():
        problems.append(f"Dataset path {data} is a file, not a folder; choose the folder that holds your images.")
    problems += _reg_dir_problems(config, data)
    model = config.pretrained_model_name_or_path
    if need_model:
        if not model:
            problems.append("pretrained_model_name_or_path is empty; point it at a checkpoint file or a "
                            "diffusers folder.")
        elif _looks_like_path(model) and not Path(model).expanduser().exists():
            problems.append(f"Model {model} does not exist; point it at a .safetensors checkpoint or a diffusers "
                            "folder.")
        elif _looks_like_path(model):
            problems += _model_problems(Path(model).expanduser())
        elif not _looks_like_path(model) and config.local_files_only and not _in_hub_cache(model):
            problems.append(f"Model '{model}' is not a local file or folder and is not in the local hub cache; "
                            "download it once or set local_files_only=false with internet access.")
    preview = Path(config.preview_model).expanduser() if config.preview_model else None
    if preview is not None and not preview.exists():
        problems.append(f"preview_model {preview} does not exist; point it at the model to make validation images "
                        "with (a .safetensors checkpoint or a diffusers folder), or leave it empty.")
    elif preview is not None:
        problems += [f"preview_model: {p}" for p in _model_problems(preview)]
    adapter = Path(config.training_adapter).expanduser() if config.training_adapter else None
    if adapter is not None and not adapter.is_file():
        problems.append(f"training_adapter {adapter} is not a file; point it at the adapter's .safetensors LoRA, or "
                        "leave it empty.")
    for knob in ("text_encoder_path", "vae_path", "tokenizer_path"):  # FLUX.2 Klein's separate files
        given = getattr(config, knob)
        if given and not Path(given).expanduser().exists():
            problems.append(f"{knob} {given} does not exist; point it at the file or folder, or leave it empty to "
                            "find it beside the model.")
    resume = config.resume_from_checkpoint
    if resume and resume not in ("auto", "latest") and not Path(resume).expanduser().is_dir():
        problems.append(f"resume_from_checkpoint: {resume} is not a checkpoint folder; give a folder "
                        "RUN/checkpoints/step_NNNNNN, or --resume auto for the newest good one.")
    out = Path(config.output_dir).expanduser()
    problems += output_inside_dataset(out, data)
    problems += output_inside_reg_dir(out, Path(config.reg_data_dir).expanduser() if config.reg_data_dir else None)
    probe = out if out.exists() else next((p for p in out.parents if p.exists()), Path("."))
    if out.exists() and not out.is_dir():
        problems.append(f"Output path {out} is a file; choose a folder for the run.")
    elif not probe.is_dir():
        problems.append(f"Output folder {out} cannot be created: {probe.name} on its way is a file, not a folder; "
                        "choose another output_dir.")
    elif not os.access(probe, os.W_OK):
        problems.append(f"Cannot write to {probe}; choose an output folder you own.")
    else:
        free_mb = shutil.disk_usage(probe).free / 2**20
        if free_mb < 200:
            problems.append(f"Only {free_mb:.0f} MB free on the disk of {probe}; free some space (checkpoints "
                            "need a few hundred MB).")
    return problems


def _output_inside(out: Path, folder: Path | None, folder_words: str, consequence: str) -> list[str]:
    """One sentence when the run folder is ``folder`` or inside it; ``consequence`` says why that is harmful."""
    if folder is None or not folder.is_dir():
        return []
    out, folder = out.resolve(), folder.resolve()
    if out == folder or out.is_relative_to(folder):
        where = f"is the {folder_words}" if out == folder else f"is inside the {folder_words}"  # its path is in out's
        return [f"output_dir {out} {where}{consequence}; choose an output folder outside it."]
    return []


def output_inside_dataset(out: Path, data: Path | None) -> list[str]:
    """A run folder in the dataset would feed the run's own samples back as training images on resume."""
    return _output_inside(out, data, "dataset folder",
                          " (train_data_dir), so the run's samples would become training images")


def output_inside_reg_dir(out: Path, reg: Path | None) -> list[str]:
    """A run folder among the class images would write the run's files there and train its samples as class
    images on the next run."""
    return _output_inside(out, reg, "regularisation folder",
                          " (reg_data_dir), so the run's files would land among the class images")


PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")


def _model_problems(path: Path) -> list[str]:
    """What is wrong with a local model path, read without loading it (the header of a .safetensors file, the
    layout of a folder); checked before the dataset scan so a bad model path costs nothing."""
    if path.is_dir():
        if (path / "model_index.json").is_file() or (path / "unet").is_dir():
            return []
        return [f"Model folder {path} is not a diffusers model (no model_index.json, no unet/ folder); point at "
                "the folder that holds model_index.json, or at a .safetensors checkpoint."]
    suffix = path.suffix.lower()
    if suffix in PICKLE_SUFFIXES:
        return [f"Model {path.name} is a {suffix} pickle, which can run code when loaded, so StableTune does not "
                "open it; convert it to .safetensors with a tool you trust and point at that file."]
    if suffix != ".safetensors":
        return [f"Model {path.name} is not a model StableTune can read; use a .safetensors checkpoint or a "
                "diffusers folder."]
    problem = safetensors_problem(path)
    return [f"Model {path.name} {problem}; download or convert it again."] if problem else []


def safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file is unusable (None when its header and size agree): its first 8 bytes give the
    header length, the JSON header gives the byte range of every tensor."""
    import json
    import struct

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            if size < 8:
                return f"is not a safetensors file (only {size} bytes)"
            (length,) = struct.unpack("<Q", f.read(8))
            if length > min(size - 8, 100 * 2**20):
                return "is not a safetensors file, or it is truncated (its header is cut off)"
            header = json.loads(f.read(length))
    except (OSError, ValueError) as exc:
        return f"cannot be read as safetensors ({exc})"
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    if not ends:
        return "holds no tensors"
    missing = 8 + length + max(ends) - size
    if missing > 0:
        return f"is truncated ({missing / 2**20:.1f} MB missing at the end; an interrupted download?)"
    return None


def _looks_like_path(source: str) -> bool:
    """Hub ids look like 'owner/name'; everything else is treated as a local path."""
    if Path(source).expanduser().exists() or source.endswith((".safetensors", ".ckpt", ".pt")):
        return True
    return re.fullmatch(r"[\w.-]+/[\w.-]+", source) is None or source.startswith(".")


def _in_hub_cache(repo_id: str) -> bool:
    hub = Path(os.environ.get("HF_HUB_CACHE", Path(os.environ.get("HF_HOME", "~/.cache/huggingface")) / "hub"))
    return (hub.expanduser() / f"models--{repo_id.replace('/', '--')}").exists()
