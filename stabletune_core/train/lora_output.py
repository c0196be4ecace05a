"""Writes a run's LoRA into RUN/output: the trained adapters, kohya's metadata of the run, and the config without
the trainer's local paths. The loop decides which files (the last adapter, its EMA, the best one); reading and
comparing LoRA files of any origin is tools/lora_file.py's job."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from ..config import PATH_KNOBS, TrainConfig
from ..data.examples import DatasetView
from ..lora.export import export_kohya_lora, write_embedding_files
from ..lora.pivotal import FORGE_UNMATCHED_LIMIT, PivotalTokens, bundle_tensors, forge_refuses_bundle
from ..models.base import ModelBundle
from ..runs import events
from ..runs.layout import forge_name
from ..runs.writer import RunWriter
from .amp import precision_dtype
from .ranks import Ranks


def write_lora(name: str, *, step: int, epoch: int, max_steps: int, config: TrainConfig, ranks: Ranks,
               run: RunWriter, bundle: ModelBundle, trained: dict[str, torch.nn.Module], data: DatasetView,
               pivotal: PivotalTokens | None = None) -> Path | None:
    """RUN/output/NAME.safetensors from the trained modules as they are now (and NAME_diffusers/ when asked),
    with kohya's metadata of the run at `step`; None on processes that do not write the run. With pivotal
    tuning the new tokens' vectors go into the file (`bundle_emb.*`, as A1111 reads them) and each token also
    into an embedding file of its own, RUN/output/NAME_embeddings/TOKEN.safetensors."""
    ranks.wait()
    if not ranks.is_main:
        return None
    unet = ranks.unwrap(trained["unet"])
    encoders = [ranks.unwrap(trained[k]) for k in trained if k.startswith("te")]
    path = run.paths.lora(name)
    # The family knows its version strings (SD2's follow the prediction type); the run knows the rest.
    metadata = {**bundle.family.metadata(bundle),
                **training_metadata(config, data, started_at=run.started_at, step=step, epoch=epoch,
                                    max_steps=max_steps)}
    dtype = precision_dtype(config.save_precision)
    vectors = pivotal.vectors_by_token() if pivotal else {}
    words = bundle_tensors(vectors, bundle.family, dtype) if vectors else {}
    path = export_kohya_lora(path, unet, encoders, bundle.family, rank=config.lora_rank,
                             alpha=config.effective_lora_alpha, metadata=metadata, dtype=dtype,
                             embeddings=words or None,
                             overwrite=True)  # RUN/output is this run's own: prepare_run_dir moved any other aside
    run.event(events.EXPORTED, f"Wrote LoRA {path.name} at step {step}.", step=step, path=str(path))
    if forge_refuses_bundle(words):  # Forge refuses a file with so many unmatched keys: give it one without them
        forge = export_kohya_lora(run.paths.lora(forge_name(name)), unet, encoders,
                                  bundle.family, rank=config.lora_rank, alpha=config.effective_lora_alpha,
                                  metadata=metadata, dtype=dtype, overwrite=True)
        run.event(events.EXPORTED, f"Wrote {forge.name}, the LoRA without its {len(words)} bundled word tensors, "
                  f"for Forge (which refuses a LoRA with more than {FORGE_UNMATCHED_LIMIT} keys it cannot match).",
                  step=step, path=str(forge))
    if vectors:
        folder = run.paths.embeddings(name)
        files = write_embedding_files(folder, vectors, bundle.family, dtype)
        run.event(events.EXPORTED, f"Wrote the new tokens' embeddings into {path.name} (bundle_emb, which A1111 "
                  f"reads) and as {', '.join(f'{folder.name}/{p.name}' for p in files)} (A1111, Forge and ComfyUI's "
                  "embeddings folders, diffusers' load_textual_inversion).", step=step, paths=[str(p) for p in files])
    if config.export_diffusers_format:
        from ..lora.export import export_diffusers_lora

        # The run's own output folder: a later export of this run (resume, early stopping's next best)
        # replaces its earlier one, file by file through a rename, never a file outside the run.
        folder = run.paths.diffusers_lora(name)
        written = export_diffusers_lora(folder, unet, encoders, bundle.family, overwrite=True)
        run.event(events.EXPORTED, f"Wrote diffusers-format LoRA {folder.name}/{written.name} at step {step}.",
                  step=step, path=str(written))
    return path


def training_metadata(config: TrainConfig, data: DatasetView, *, started_at: float, step: int, epoch: int,
                      max_steps: int) -> dict[str, str]:
    """kohya's ss_* keys as this run trained (they override the family's defaults), and the config without
    the user's local paths."""
    return {
        "ss_output_name": config.output_name,
        "ss_sd_model_name": Path(config.pretrained_model_name_or_path).name,
        "ss_resolution": f"({config.resolution}, {config.resolution})",
        "modelspec.resolution": f"{config.resolution}x{config.resolution}",
        "ss_tag_frequency": json.dumps(data.scan.tag_frequency()),
        "ss_reg_dataset_dirs": json.dumps(data.scan.reg_dataset_dirs()),
        "ss_num_reg_images": str(sum(item.is_reg for item in data.items)),
        "ss_prior_loss_weight": str(config.prior_loss_weight),
        "ss_training_started_at": str(started_at),
        "ss_training_finished_at": str(time.time()),
        "ss_steps": str(step),
        "ss_max_train_steps": str(max_steps),
        "ss_epoch": str(epoch + 1),  # kohya counts epochs from 1; the state's epoch is the one being drawn from
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
        "ss_num_train_images": str(sum(not item.is_reg for item in data.items)),
        "stabletune_config": json.dumps(shareable_config(config)),
        # the frozen base the LoRA was trained against, when it was not stored in full (files of other runs unchanged)
        **({"stabletune_base_storage": config.base_storage} if config.base_storage != "full" else {}),
    }


def shareable_config(config: TrainConfig) -> dict[str, Any]:
    """The config as it goes into a LoRA people share: folders and files by their names only (the run's own
    folder is "."), never the absolute paths of the machine it was trained on; a hub id stays as it is."""
    values = config.model_dump(mode="json")
    run = Path(config.output_dir).expanduser().resolve()
    for key in PATH_KNOBS:  # every knob the schema marks as a path of the user's machine
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
