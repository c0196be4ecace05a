"""The run's LoRA files: the last adapter, its EMA, and the best one (early stopping), with kohya metadata."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from ..config import TrainConfig
from ..lora.export import export_kohya_lora
from .checkpoint import load_checkpoint
from .optim import evaluation_weights
from .session import Session
from .state import adapter_state, restore_adapter


def export(s: Session, name: str | None = None, *, step: int | None = None) -> Path | None:
    """The LoRA as trained, and with ema_decay its moving average beside it as NAME-ema.safetensors. `step`: the
    step the weights come from (the file's ss_steps), when not the current one."""
    step = s.state.step if step is None else step
    with evaluation_weights(s.optimizer):  # schedule-free: export the averaged weights, not the training point
        path = _export(s, name, step)
    if s.ema:
        with s.ema.swapped_in():
            _export(s, f"{name or s.config.output_name}-ema", step)
    return path


def export_best(s: Session) -> Path | None:
    """Export the best checkpoint as <output_name>_best, then put the current state back.

    Everything the export reads comes from the best step: the adapter, the EMA beside it (`_best-ema` is the
    average *at* the best step, not the one of the last step) and the optimizer state (a schedule-free
    optimizer's evaluation weights are computed from it)."""
    if not s.best_checkpoint:
        return None
    best = load_checkpoint(Path(s.best_checkpoint))
    current = adapter_state(s)
    current_optimizer = s.optimizer.state_dict()  # load_state_dict replaces these tensors, it does not write them
    current_ema = s.ema.state_dict() if s.ema else None
    try:
        restore_adapter(s, best.adapter)
        s.optimizer.load_state_dict(best.state["optimizer"])
        if s.ema and best.state.get("ema"):
            s.ema.load_state_dict(best.state["ema"])
        return export(s, f"{s.config.output_name}_best", step=best.step)  # ss_steps: the step it comes from
    finally:
        restore_adapter(s, current)
        s.optimizer.load_state_dict(current_optimizer)
        if current_ema is not None:
            s.ema.load_state_dict(current_ema)


def _export(s: Session, name: str | None, step: int) -> Path | None:
    s.accelerator.wait_for_everyone()
    if not s.accelerator.is_main_process:
        return None
    config = s.config
    unet = s.accelerator.unwrap_model(s.trained["unet"])
    encoders = [s.accelerator.unwrap_model(s.trained[k]) for k in s.trained if k.startswith("te")]
    path = s.run.paths.output / f"{name or config.output_name}.safetensors"
    # The family knows its version strings (SD2's follow the prediction type); the run knows the rest.
    metadata = {**s.bundle.family.metadata(s.bundle), **training_metadata(s, step)}
    path = export_kohya_lora(path, unet, encoders, s.bundle.family, rank=config.lora_rank,
                             alpha=config.effective_lora_alpha, metadata=metadata,
                             dtype={"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.save_precision,
                                                                                       torch.float32),
                             overwrite=True)  # RUN/output is this run's own: prepare_run_dir moved any other aside
    s.run.event("exported", f"Wrote LoRA {path.name} at step {step}.", step=step, path=str(path))
    if config.export_diffusers_format:
        from ..lora.export import export_diffusers_lora

        # The run's own output folder: a later export of this run (resume, early stopping's next best)
        # replaces its earlier one, file by file through a rename, never a file outside the run.
        folder = s.run.paths.output / f"{name or config.output_name}_diffusers"
        written = export_diffusers_lora(folder, unet, encoders, s.bundle.family, overwrite=True)
        s.run.event("exported", f"Wrote diffusers-format LoRA {folder.name}/{written.name} at step {step}.",
                    step=step, path=str(written))
    return path


def training_metadata(s: Session, step: int) -> dict[str, str]:
    """kohya's ss_* keys as this run trained (they override the family's defaults), and the config without
    the user's local paths."""
    config = s.config
    return {
        "ss_output_name": config.output_name,
        "ss_sd_model_name": Path(config.pretrained_model_name_or_path).name,
        "ss_resolution": f"({config.resolution}, {config.resolution})",
        "modelspec.resolution": f"{config.resolution}x{config.resolution}",
        "ss_tag_frequency": json.dumps(s.data.scan.tag_frequency()),
        "ss_reg_dataset_dirs": json.dumps(s.data.scan.reg_dataset_dirs()),
        "ss_num_reg_images": str(sum(item.is_reg for item in s.data.items)),
        "ss_prior_loss_weight": str(config.prior_loss_weight),
        "ss_training_started_at": str(s.run._started),
        "ss_training_finished_at": str(time.time()),
        "ss_steps": str(step),
        "ss_max_train_steps": str(s.max_steps),
        "ss_epoch": str(s.state.epoch + 1),  # kohya counts epochs from 1; state.epoch is the one being drawn from
        "ss_learning_rate": str(config.learning_rate),
        "ss_text_encoder_lr": str(config.text_encoder_lr or config.learning_rate),
        "ss_unet_lr": str(config.learning_rate),
        "ss_batch_size_per_device": str(config.train_batch_size),
        "ss_gradient_accumulation_steps": str(config.gradient_accumulation_steps),
        "ss_lr_scheduler": config.lr_scheduler,
        "ss_lr_warmup_steps": str(config.lr_warmup_steps),
        "ss_mixed_precision": config.mixed_precision,
        "ss_seed": str(config.seed),
        "ss_noise_offset": str(config.noise_offset),
        "ss_min_snr_gamma": str(config.snr_gamma),
        "ss_multires_noise_iterations": str(config.multires_noise_iterations or None),
        "ss_multires_noise_discount": str(config.multires_noise_discount),
        "ss_ip_noise_gamma": str(config.ip_noise_gamma or None),
        "ss_debiased_estimation": str(config.debiased_estimation_loss),
        "ss_network_dropout": str(config.lora_dropout),
        "ss_num_train_images": str(sum(not item.is_reg for item in s.data.items)),
        "stabletune_config": json.dumps(shareable_config(config)),
    }


def shareable_config(config: TrainConfig) -> dict[str, Any]:
    """The config as it goes into a LoRA people share: folders and files by their names only (the run's own
    folder is "."), never the absolute paths of the machine it was trained on; a hub id stays as it is."""
    values = config.model_dump(mode="json")
    run = Path(config.output_dir).expanduser().resolve()
    for key in ("pretrained_model_name_or_path", "train_data_dir", "model_config_dir", "resume_from_checkpoint"):
        value = values.get(key)
        if not value or value in ("auto", "latest"):
            continue
        path = Path(value).expanduser()
        if not (path.is_absolute() or path.exists()):
            continue  # a hub id
        path = path.resolve()
        values[key] = path.relative_to(run).as_posix() if path.is_relative_to(run) else path.name
    values["output_dir"] = "."
    return values
