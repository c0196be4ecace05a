"""The training loop. Read it top to bottom: set up, resume, then one optimizer step at a time.

Everything that makes a run survive (non-finite losses, out-of-memory, clipping, checkpoints) lives in
guard objects called at fixed points of the step; everything the world should know goes to the run
directory through `RunWriter`.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import sys
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from tqdm.auto import tqdm

from ..config import ConfigError, TrainConfig, check_inputs
from ..data.dataset import (BatchFeed, BucketBatchSampler, DatasetView, EmbeddingCache, LatentCache,
                            derive_seed, module_fingerprint)
from ..data.masks import batch_loss_mask, masks_note
from ..data.reg import merge_reg, scan_reg_images
from ..data.scan import scan_dataset
from ..cache import cache_root
from ..lora.export import export_kohya_lora
from ..lora.inject import add_lora, load_lora_state_dict, lora_parameters, lora_state_dict
from ..models.loading import load_model
from ..models.base import Conditioning, ModelBundle
from ..runs.reader import RunReader
from ..runs.earlier import earlier_run
from ..runs.writer import RunWriter
from . import faults, signals
from .amp import MixedPrecision
from .guards import Guard, make_guards
from .checkpoint import (Checkpoint, CheckpointError, latest_good_checkpoint, load_checkpoint, prune_checkpoints,
                         remove_stale_temporaries, save_checkpoint)
from .outcome import RunFailed
from .loss import LossParts, add_noise, diffusion_loss, prior_weights, target_for
from .memory import memory_stats
from .ema import AdapterEMA, optional_swap
from .optim import evaluation_weights, make_lr_scheduler, make_optimizer, optimizer_problems, unet_param_groups
from .perceptual import Perceptual, perceptual_problems
from .placement import frozen_modules_to_offload, offload
from .sampling import make_validation_images
from .tensorboard import make_tensorboard_log
from .validation import split_validation


class RunExists(ConfigError):
    """The output folder holds an earlier run. The sentence is the failure; the earlier run's own status.json
    and events.jsonl must not be rewritten to say so (they describe that run, not this refusal)."""

    earlier_run_untouched = True


@dataclass
class TrainState:
    """Counters that a checkpoint must restore for a run to continue exactly."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0
    batch_in_epoch: int = 0  # sampler batches of `epoch` already consumed
    images_seen: int = 0
    micro_batch_size: int = 0  # may shrink after an out-of-memory error; the effective batch never does

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


@dataclass
class Session:
    """What setup builds and every part of the step uses."""

    config: TrainConfig
    accelerator: Accelerator
    run: RunWriter
    bundle: ModelBundle
    data: DatasetView
    sampler: BucketBatchSampler
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    params: list[torch.nn.Parameter]
    trained: dict[str, torch.nn.Module]  # modules with adapters, by checkpoint prefix
    state: TrainState
    max_steps: int
    generator: torch.Generator  # noise and timesteps
    weight_dtype: torch.dtype
    amp: MixedPrecision  # autocast and the fp16 loss scaler (amp.py), not accelerate's
    latent_cache: Any = None
    text_cache: Any = None
    guards: list[Guard] = field(default_factory=list)
    batch_paths: list[str] = field(default_factory=list)  # images of the current step, for the guards' events
    best_checkpoint: Path | None = None  # set by the guard that judges "best"; pruning always keeps it
    validation_items: list[Any] = field(default_factory=list)  # images held out of training (validation_split)
    perceptual: Any = None  # the LPIPS regulariser (perceptual.py) when perceptual_lambda > 0
    sample_scores: dict[str, dict[str, float]] = field(default_factory=dict)  # sample_judge: first and last
    tensorboard: Any = None  # report_to=tensorboard: an observer of the logged metrics and samples
    feed: BatchFeed | None = None  # the DataLoader that next_batches draws from (made at its first call)
    resume_from: Any = None  # the checkpoint setup found to resume from (read before any model loaded)
    checkpoint_failures: int = 0  # checkpoints in a row that could not be written (a full disk)
    ema: AdapterEMA | None = None  # ema_decay > 0: the moving average of the adapter weights
    loss_parts: LossParts = field(default_factory=LossParts)  # this step's instance / prior loss (reg_data_dir)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def guard(self, name: str) -> Guard | None:
        return next((g for g in self.guards if g.name == name), None)


# ---- set up -----------------------------------------------------------------------------------------------
#: What a run leaves in RUN/ (see runs/layout.py); train.log stays: the UI's launcher holds it open for this run.
RUN_ARTEFACTS = ("config.toml", "status.json", "metrics.jsonl", "events.jsonl", "control.json", "samples",
                 "diagnostics", "checkpoints", "output", "cache")


def prepare_run_dir(config: TrainConfig) -> RunWriter:
    """Never write over an earlier run: refuse (one sentence), or with --overwrite_output_dir move it aside.

    Runs before the dataset scan and the model load. A folder that only holds this run's own config.toml (the
    UI writes it, then starts the engine on it) or a run that never trained a step is not an earlier run.
    """
    writer = RunWriter(config.output_dir, enabled=False)
    if config.resume_from_checkpoint:
        return writer
    found = earlier_run(writer.paths, config)
    if not found:
        return writer
    root = writer.paths.root
    aside = root / f"previous-{time.strftime('%Y%m%d-%H%M%S')}"
    if not config.overwrite_output_dir:
        raise RunExists([f"Output folder {root} already holds an earlier run ({found}); pass --resume auto to "
                         f"continue it, choose a new --output_dir, or pass --overwrite_output_dir to move it aside "
                         f"into {aside.name}/ and start afresh."])
    if os.environ.get("RANK", "0") == "0":  # with several processes, the first one moves; nothing is deleted
        n = 2
        while aside.exists():
            aside, n = root / f"previous-{time.strftime('%Y%m%d-%H%M%S')}-{n}", n + 1
        aside.mkdir()
        for name in RUN_ARTEFACTS:
            if (root / name).exists():
                (root / name).rename(aside / name)
        print(f"note: moved the earlier run in {root} aside into {aside.name}/ (--overwrite_output_dir).",
              file=sys.stderr)
    return writer


def resolve_seed(config: TrainConfig) -> tuple[TrainConfig, bool]:
    """Seed -1 means "random" (as in the WebUIs): draw one and put it in the config, which is saved as the run's
    config.toml, so the run can be resumed and repeated. Returns (config, whether a seed was drawn)."""
    if config.seed != -1:
        return config, False
    import secrets

    return config.model_copy(update={"seed": secrets.randbelow(2**32)}), True


def find_resume_checkpoint(config: TrainConfig, report: Any) -> Checkpoint | None:
    """The checkpoint `resume_from_checkpoint` names, read and verified before any model loads.

    An explicit path that is missing or corrupt is refused. With auto/latest the newest good one wins (each bad
    one is reported); when there are checkpoints and none can be read, the run is refused rather than silently
    restarted from step 0, unless `allow_restart` says so.
    """
    target = config.resume_from_checkpoint
    if not target:
        return None
    if target not in ("auto", "latest"):  # check_inputs made sure it is a folder
        path = Path(target).expanduser()
        try:
            return load_checkpoint(path)
        except (CheckpointError, RuntimeError, OSError, ValueError) as exc:
            raise RunFailed(f"Cannot resume from {path}: {str(exc).rstrip('.')}. Choose another checkpoint folder, "
                            "or --resume auto for the newest good one.") from None
    parent = RunWriter(config.output_dir, enabled=False).paths.checkpoints
    bad: list[str] = []
    checkpoint = latest_good_checkpoint(parent, report=lambda message: (bad.append(message), report(message)))
    if checkpoint is None and bad and not config.allow_restart:
        raise RunFailed(f"None of the {len(bad)} checkpoints in {parent} can be read ({bad[0].split(' Falling')[0]}"
                        "); nothing was changed. Pass --allow_restart to start this run over from step 0 (the bad "
                        "checkpoints are kept), or resume from a copy of a good checkpoint.")
    return checkpoint


def weight_dtype_for(config: TrainConfig) -> torch.dtype:
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.mixed_precision, torch.float32)


def setup(config: TrainConfig) -> Session:
    """Check everything the user pointed at (model, resume checkpoint, then the dataset) before any model loads."""
    config, random_seed = resolve_seed(config)
    problems = check_inputs(config) + perceptual_problems(config) + optimizer_problems(config)
    if problems:
        raise ConfigError(problems)
    prepare_run_dir(config)
    bad_checkpoints: list[str] = []
    resume_from = find_resume_checkpoint(config, bad_checkpoints.append)
    accelerator = Accelerator(mixed_precision="no")  # mixed precision is ours (amp.py): the fallback switches it
    amp = MixedPrecision(config.mixed_precision, accelerator.device)  # refuses a dtype the device lacks, early
    previous = RunReader(config.output_dir).status()  # read before our own heartbeat replaces it
    run = RunWriter(config.output_dir, enabled=accelerator.is_main_process)
    run.status("starting", step=0)
    if previous.get("stale"):
        run.event("previous_died", f"The previous process {previous.get('pid')} died at step "
                  f"{previous.get('step', 0)} (it was {previous.get('reported_state') or previous.get('state')}; status.json went stale).",
                  step=previous.get("step"), pid=previous.get("pid"))
    if accelerator.is_main_process:
        config.save_toml(run.paths.config)
        for leftover in remove_stale_temporaries(run.paths.checkpoints):
            run.event("checkpoint_bad", f"Removed {leftover.name}: a checkpoint whose writing was interrupted.")
    for message in bad_checkpoints:
        run.event("checkpoint_bad", message, console=True)
    if resume_from is None and config.resume_from_checkpoint:
        run.event("resume", "No checkpoint to resume from; starting from step 0." if not bad_checkpoints else
                  "No checkpoint could be read; starting over from step 0 (allow_restart).", console=True)
    if random_seed:
        run.event("seed", f"Seed -1: this run uses the random seed {config.seed} (recorded in config.toml, so "
                  "--resume and a rerun with that seed repeat it).", console=True, seed=config.seed)
    if config.mixed_precision != "no" and accelerator.device.type == "cpu":
        run.event("precision", f"{config.mixed_precision} was requested but there is no GPU: the frozen model runs "
                  f"in {config.mixed_precision} on the CPU, which is slow; use mixed_precision no on a CPU.",
                  console=True)
    for note in config.notes():
        run.event("config", note)
    set_seed(config.seed)

    scan = scan_dataset(Path(config.train_data_dir), config.default_caption, config.caption_extension)
    for skipped in scan.skipped:
        run.event("data_skipped", f"Skipped {skipped.path}: {skipped.reason}", path=str(skipped.path))
    if scan.skipped:
        run.event("data_skipped", f"Skipped {len(scan.skipped)} unreadable image(s), e.g. {scan.skipped[0].path.name}: "
                  f"{scan.skipped[0].reason} (all listed in events.jsonl).", console=True)
    scan, held_out = split_validation(scan, config)  # held-out images never reach the sampler
    if held_out:
        how = "validation_split empty: automatic" if config.validation_split is None else "validation_split"
        run.event("validation_split", f"Held {len(held_out)} of {len(held_out) + len(scan.items)} images out of "
                  f"training to measure validation loss on ({how}; set validation_split = 0 to train on all).",
                  held_out=[str(item.path) for item in held_out])
    if config.reg_data_dir:  # after the split: held-out images are instance images only
        reg = scan_reg_images(Path(config.reg_data_dir), scan.total_with_repeats, config.default_caption,
                              config.caption_extension)
        run.event("reg_images", f"Prior preservation: {len(reg.items)} regularisation image(s) from "
                  f"{config.reg_data_dir}, {reg.total_with_repeats} per epoch, loss weight {config.prior_loss_weight}.",
                  console=True)
        scan = merge_reg(scan, reg)
    data = DatasetView.from_config(scan, config)
    for note in data.notes:
        run.event("data", note)
    if config.masked_loss and (note := masks_note(data.items)):
        run.event("data", note)
    sampler = data.sampler(config.train_batch_size)

    run.status("loading", step=0)
    bundle = load_model(config)
    if config.prediction_type:
        bundle.noise_scheduler.register_to_config(prediction_type=config.prediction_type)
    add_lora(bundle, config)
    weight_dtype = weight_dtype_for(config)
    device = accelerator.device
    bundle.vae.to(device, dtype=torch.float32 if config.mixed_precision == "fp16" else weight_dtype)
    bundle.unet.to(device, dtype=weight_dtype)
    for encoder in bundle.text_encoders:
        encoder.to(device, dtype=weight_dtype)
    trained = {"unet": bundle.unet, **({f"te{i}": e for i, e in enumerate(bundle.text_encoders)}
                                       if config.train_text_encoder else {})}
    for module in trained.values():  # adapters train in fp32 whatever the base runs in
        for p in lora_parameters(module):
            p.data = p.data.float()
    if config.gradient_checkpointing:
        bundle.unet.enable_gradient_checkpointing()
        if config.train_text_encoder:
            for encoder in bundle.text_encoders:
                encoder.gradient_checkpointing_enable()
    enable_fast_attention(bundle, config, run)
    if config.allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True

    groups = unet_param_groups(bundle.unet, config)  # block-wise rates; a block at rate 0 is frozen
    if config.train_text_encoder:
        te_params = [p for e in bundle.text_encoders for p in lora_parameters(e)]
        groups.append({"params": te_params, "lr": config.text_encoder_lr or config.learning_rate})
    effective_batch = config.train_batch_size * config.gradient_accumulation_steps * accelerator.num_processes
    if accelerator.num_processes > 1:
        run.event("processes", f"Training on {accelerator.num_processes} processes ({accelerator.distributed_type}); "
                  f"effective batch {effective_batch}.", processes=accelerator.num_processes)
    if config.scale_lr:
        for g in groups:
            g["lr"] *= effective_batch
    optimizer = make_optimizer(groups, config)
    steps_per_epoch = math.ceil(len(sampler) / (config.gradient_accumulation_steps * accelerator.num_processes))
    max_steps = config.max_train_steps or config.num_train_epochs * steps_per_epoch
    if config.validation_epochs:  # diffusers' flag, in epochs: the loop counts steps
        config.validation_steps = config.validation_epochs * steps_per_epoch
        run.event("config", f"validation_epochs {config.validation_epochs} = validation images every "
                  f"{config.validation_steps} steps ({steps_per_epoch} steps per epoch).")
    lr_scheduler = make_lr_scheduler(optimizer, config, max_steps)
    if config.lr_warmup_steps >= max_steps and config.lr_scheduler not in ("constant", "plateau"):
        run.event("config", f"lr_warmup_steps ({config.lr_warmup_steps}) is not shorter than the run ({max_steps} "
                  "steps): the learning rate never reaches its peak; lower lr_warmup_steps.", console=True)
    prepared = accelerator.prepare(*trained.values(), optimizer)
    trained = dict(zip(trained, prepared[:-1]))
    optimizer = prepared[-1]

    session = Session(config=config, accelerator=accelerator, run=run, bundle=bundle, data=data, sampler=sampler,
                      optimizer=optimizer, lr_scheduler=lr_scheduler,
                      params=[p for g in groups for p in g["params"]], trained=trained,
                      state=TrainState(micro_batch_size=config.train_batch_size), max_steps=max_steps,
                      generator=torch.Generator().manual_seed(config.seed), weight_dtype=weight_dtype,
                      amp=amp,
                      guards=make_guards(config), validation_items=held_out, resume_from=resume_from)
    if config.ema_decay > 0:
        session.ema = AdapterEMA(session.params, config.ema_decay, on_cpu=config.ema_on_cpu)
    if config.perceptual_lambda > 0:
        session.perceptual = Perceptual(config, device, run)
    if accelerator.is_main_process:  # report_to: observers fed by the loop, never deciding anything
        session.tensorboard, note = make_tensorboard_log(config, run.paths.root)
        if note:
            run.event("config", note)
            print(f"note: {note}", file=sys.stderr)
    build_caches(session)
    if faults.ACTIVE:
        faults.arm_oom(session)
    return session


def enable_fast_attention(bundle: ModelBundle, config: TrainConfig, run: RunWriter) -> None:
    """PyTorch SDPA is diffusers' default; xformers only when asked for and importable."""
    if not config.enable_xformers_memory_efficient_attention:
        return
    try:
        import xformers  # noqa: F401

        bundle.unet.enable_xformers_memory_efficient_attention()
        run.event("attention", "Using xformers memory-efficient attention.")
    except Exception as exc:  # not installed, or no kernel for this device
        run.event("attention", f"xformers is not usable here ({type(exc).__name__}); using PyTorch SDPA, which "
                  "is as memory-efficient on PyTorch 2.", console=True)


def build_caches(s: Session) -> None:
    """Encode latents and caption embeddings once; then the modules no step needs go to the CPU (placement.py).

    With cache_latents_to_disk the latents go to a cache shared by every run (STABLETUNE_CACHE, default
    ~/.cache/stabletune/latents), keyed by the image's bytes, its bucket and crop, and the VAE's weights and
    dtype, so a later run on the same images skips encoding. Each latent is a posterior sample seeded by its
    own pixels: the same whether this run encoded it or found it cached, and the run's RNG is not touched.
    """
    config = s.config
    folder = Path(config.output_dir) / "cache" if config.cache_latents_to_disk else None
    model_id = f"{Path(config.pretrained_model_name_or_path).resolve()}|{config.mixed_precision}"
    if config.cache_latents:
        s.run.status("caching", step=s.state.step)
        shared = cache_root() / "latents" if config.cache_latents_to_disk else None
        vae_id = f"{module_fingerprint(s.bundle.vae)}|{s.bundle.vae.dtype}" if shared else "this-run"
        s.latent_cache = LatentCache(shared, model_id=vae_id)

        def encode(pixels: torch.Tensor) -> torch.Tensor:
            seed = derive_seed("cached-latent", hashlib.sha256(pixels.numpy().tobytes()).hexdigest())
            return encode_pixels(s, pixels, torch.Generator().manual_seed(seed % 2**63))

        encoded = s.latent_cache.build(s.data, encode, disable=not s.accelerator.is_main_process)
        where = f" in {shared}" if shared else ""
        s.run.event("latent_cache", f"Encoded {encoded} images and reused {s.latent_cache.reused} cached latents"
                    f"{where}.", encoded=encoded, reused=s.latent_cache.reused, folder=str(shared) if shared else None)
    if config.cache_text_embeddings:
        s.text_cache = EmbeddingCache(folder / "text" if folder else None, model_id=model_id)
        s.text_cache.build(s.data, lambda captions: encode_text(s, captions, grad=False),
                           disable=not s.accelerator.is_main_process)
    off = frozen_modules_to_offload(s.bundle, config, latents_cached=s.latent_cache is not None,
                                    text_cached=s.text_cache is not None)
    if off:
        offload(off.values(), s.device)
        s.run.event("placement", f"{', '.join(off)} stay on the CPU after caching: their outputs are cached, so "
                    f"only sampling brings them to {s.device}.", modules=list(off), device=str(s.device))


# ---- the pieces of a step ----------------------------------------------------------------------------------
@torch.no_grad()
def encode_pixels(s: Session, pixels: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    vae = s.bundle.vae
    latents = vae.encode(pixels.to(s.device, dtype=vae.dtype)).latent_dist.sample(generator=generator)
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return ((latents - shift) * s.bundle.latent_scaling).float()


def encode_text(s: Session, captions: list[str], *, grad: bool) -> dict[str, torch.Tensor]:
    """The family's text tensors, from the bundle's own encoders. With several processes their LoRA gradients are
    summed across ranks with the UNet's in `sum_gradients_across_ranks`; calling the DDP wrappers instead would
    broadcast the encoders' buffers (CLIP's position ids) inside every forward: a collective in the middle of a
    step, where a rank that ran out of memory would never meet it."""
    with torch.set_grad_enabled(grad), s.amp.autocast():
        return s.bundle.family.encode_text(s.bundle, captions)


def latents_for(s: Session, batch: dict[str, Any]) -> torch.Tensor:
    if s.latent_cache is not None:
        return s.latent_cache.get_batch(batch["index"]).to(s.device)
    return encode_pixels(s, batch["pixel_values"], noise_generator(s, batch, "vae"))


def conditioning_for(s: Session, batch: dict[str, Any], rows: slice) -> Conditioning:
    captions = batch["caption"][rows]
    if s.text_cache is not None:
        text = {k: v.to(s.device) for k, v in s.text_cache.get_batch(captions).items()}
    else:
        text = encode_text(s, captions, grad=s.config.train_text_encoder)
    return s.bundle.family.make_conditioning(s.bundle, text, batch["sizes"][rows])


def micro_chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def forward_backward(s: Session, batches: list[dict[str, Any]]) -> float:
    """Mean loss over every image of one optimizer step (all processes), gradients accumulated.

    Noise and timesteps are drawn per sampler batch before it is split into micro-batches, so shrinking the
    micro-batch after an OOM changes nothing but memory use; they come from a generator seeded by the batch's
    place in the global order, so they do not depend on the number of processes either. The gradient is the
    mean over every image of the step on every process, however unevenly the images are spread over ranks.

    With several processes nothing here talks to the other ranks while a rank computes (no DDP hook fires in
    a backward): each phase ends in one all-reduce that also says whether any rank ran out of memory, so every
    rank retries (or goes on) together instead of hanging in a collective that the failed rank never reaches.
    """
    several = s.accelerator.num_processes > 1
    images = sum(len(b["caption"]) for b in batches)
    work, perceptual_count, failure = [], 0, None
    try:
        for batch in batches:
            latents = latents_for(s, batch)
            # masked loss: None when masks are off or no image of the batch has one
            batch["latent_mask"] = batch_loss_mask(batch, latents.shape[-2:]) if s.config.masked_loss else None
            noisy, noise, timesteps = add_noise(s.bundle.noise_scheduler, latents, noise_generator(s, batch),
                                                noise_offset=s.config.noise_offset,
                                                multires_noise_iterations=s.config.multires_noise_iterations,
                                                multires_noise_discount=s.config.multires_noise_discount,
                                                ip_noise_gamma=s.config.ip_noise_gamma)
            target = target_for(s.bundle.noise_scheduler, s.bundle.prediction_type, latents, noise, timesteps)
            # The LPIPS rows are chosen per sampler batch, so micro-batching cannot change who gets the term.
            chosen = s.perceptual.chosen_rows(s.state.step, timesteps) if s.perceptual else []
            perceptual_count += len(chosen)
            for rows in micro_chunks(len(batch["caption"]), s.state.micro_batch_size):
                work.append((batch, rows, noisy, target, timesteps,
                             [i for i in chosen if rows.start <= i < rows.stop]))
    except torch.cuda.OutOfMemoryError as exc:
        if not several:
            raise
        failure = (str(exc).splitlines() or ["CUDA out of memory"])[0]
    if several:
        images, perceptual_count = (int(n) for n in agree_across_ranks(s, [images, perceptual_count], failure))
    unet = s.trained["unet"]
    loss_sum = torch.zeros((), device=s.device)
    s.loss_parts.reset()  # a retry after an out-of-memory error starts the step's parts again
    try:
        with contextlib.ExitStack() as no_sync:  # with several processes, gradients are summed once, below
            for module in s.trained.values():
                no_sync.enter_context(s.accelerator.no_sync(module))
            for batch, rows, noisy, target, timesteps, chosen in work:
                cond = conditioning_for(s, batch, rows)
                with s.amp.autocast():
                    pred = unet(noisy[rows].to(s.weight_dtype), timesteps[rows],
                                encoder_hidden_states=cond.encoder_hidden_states,
                                added_cond_kwargs=cond.added_cond_kwargs).sample
                mask = batch["latent_mask"]
                per_sample = diffusion_loss(pred, target[rows], s.bundle.noise_scheduler, timesteps[rows],
                                            prediction_type=s.bundle.prediction_type, snr_gamma=s.config.snr_gamma,
                                            debiased=s.config.debiased_estimation_loss,
                                            mask=None if mask is None else mask[rows])
                is_reg = batch["is_reg"][rows]
                s.loss_parts.add(per_sample, is_reg)
                loss = (per_sample * prior_weights(is_reg, s.config.prior_loss_weight, per_sample.device)).sum()
                objective = loss / images
                if chosen:  # joins the gradients as lambda x the step's mean LPIPS, not the reported loss
                    objective = objective + s.perceptual.term(s, batch, rows, chosen, pred, noisy[rows],
                                                              timesteps[rows]) / perceptual_count
                s.accelerator.backward(s.amp.scale(objective))
                loss_sum += loss.detach().float()  # no .item() here: one device sync per step, not per micro-batch
    except torch.cuda.OutOfMemoryError as exc:
        if not several:
            raise
        failure = (str(exc).splitlines() or ["CUDA out of memory"])[0]
    if several:
        (loss_sum,) = agree_across_ranks(s, [loss_sum], failure)
        sum_gradients_across_ranks(s)
    return float(loss_sum) / images


def agree_across_ranks(s: Session, values: list[float | torch.Tensor], failure: str | None) -> torch.Tensor:
    """`values` summed over all ranks, in one all-reduce that also carries whether this rank ran out of memory.
    If any rank did, every rank raises the same out-of-memory error naming them, so the memory guard shrinks
    the micro-batch on every rank (or stops every rank) alike."""
    flags = [torch.as_tensor(float(failure is not None)), *(torch.as_tensor(v).float() for v in values)]
    summed = s.accelerator.reduce(torch.stack([f.to(s.device) for f in flags]), "sum")
    if summed[0] > 0:
        from accelerate.utils import gather_object

        reasons = [f"rank {rank}: {reason}" for rank, reason in enumerate(gather_object([failure])) if reason]
        raise torch.cuda.OutOfMemoryError(f"CUDA out of memory on {len(reasons)} of {s.accelerator.num_processes} "
                                          f"processes ({'; '.join(reasons)}).")
    return summed[1:]


def sum_gradients_across_ranks(s: Session) -> None:
    """Sum the LoRA gradients (text encoders' included) over ranks in one all-reduce; each rank already divided
    by the global image count, so the sum is the gradient of the global mean loss."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in s.params]
    flat = s.accelerator.reduce(torch.cat([g.flatten() for g in grads]), "sum")
    for p, chunk in zip(s.params, flat.split([g.numel() for g in grads])):
        if p.grad is not None:
            p.grad.copy_(chunk.view_as(p.grad))


def global_image_count(s: Session, batches: list[dict[str, Any]]) -> int:
    """Images of this step on every process (ranks may hold different counts when buckets end unevenly)."""
    count = sum(len(b["caption"]) for b in batches)
    if s.accelerator.num_processes > 1:
        count = int(s.accelerator.reduce(torch.tensor(float(count), device=s.device), "sum"))
    return count


def noise_generator(s: Session, batch: dict[str, Any], purpose: str = "noise") -> torch.Generator:
    """The generator of one sampler batch's noise and timesteps (or its VAE posterior sample), seeded by
    (seed, epoch, place in the epoch): never by how many batches this process drew before."""
    epoch, place = batch.get("position", (s.state.epoch, s.state.batch_in_epoch))
    return torch.Generator().manual_seed(derive_seed(purpose, s.config.seed, epoch, place) % 2**63)


def next_batches(s: Session, count: int) -> list[dict[str, Any]]:
    """This process's share of the next `count` x processes sampler batches; moves the data position.

    Every process walks the same global order and takes every world-th batch, so the global batch of a step
    is the same whatever the number of processes. The batches come from a torch DataLoader (data/dataset.py
    `BatchFeed`) whose workers decode the next ones while this step runs; it is made at the first call, after
    a resume has restored the data position, and restarted if that position moved under it.
    """
    position = (s.state.epoch, s.state.batch_in_epoch)
    if s.feed is None:
        config = s.config
        s.feed = BatchFeed(s.data, s.sampler, position, with_pixels=s.latent_cache is None,
                           num_workers=config.dataloader_num_workers, world=s.accelerator.num_processes,
                           rank=s.accelerator.process_index, pin_memory=s.device.type == "cuda")
    elif s.feed.position != position:
        s.feed.restart(position)
    batches = [next(s.feed) for _ in range(count)]
    s.state.epoch, s.state.batch_in_epoch = s.feed.position
    return batches


def clip_gradients(s: Session) -> float:
    """Clip to the clipping guard's threshold (fixed or adaptive); returns the norm before clipping.

    A non-finite norm leaves the gradients as they are, so the non-finite guard can name the bad tensors.
    """
    clip = s.guard("clipping")
    max_norm = clip.threshold() if clip else math.inf
    s.amp.unscale_(s.optimizer)  # fp16: clip and check the true gradients, not the scaled ones
    grads = [p.grad for p in s.params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if math.isfinite(max_norm) and torch.isfinite(norm):
        torch.nn.utils.clip_grads_with_norm_(s.params, max_norm, norm)
    return float(norm)


def training_step(s: Session, batches: list[dict[str, Any]]) -> tuple[float, float]:
    """Forward, backward, clip, ask the guards, optimizer step. Returns (loss, gradient norm before clipping)."""
    memory = s.guard("memory")  # out-of-memory: retried with a smaller micro-batch
    loss = memory.run(s, lambda: forward_backward(s, batches)) if memory else forward_backward(s, batches)
    if faults.ACTIVE:
        loss = faults.corrupt_step(s, loss)
    grad_norm = clip_gradients(s)
    verdicts = [guard.before_optimizer_step(s, loss, grad_norm) for guard in s.guards]
    if all(verdicts):
        s.amp.step(s.optimizer)
        if s.ema:
            s.ema.update()
    s.lr_scheduler.step()
    s.optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


# ---- checkpoints ---------------------------------------------------------------------------------------
def rng_state(s: Session) -> dict[str, Any]:
    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": torch.tensor(py_state, dtype=torch.int64), "python_version": py_version,
        "numpy": torch.from_numpy(np_state[1].astype(np.int64)), "numpy_pos": int(np_state[2]),
        "torch": torch.get_rng_state(), "loop": s.generator.get_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng(s: Session, rng: dict[str, Any]) -> None:
    random.setstate((rng["python_version"], tuple(int(x) for x in rng["python"].tolist()), None))
    np.random.set_state(("MT19937", rng["numpy"].numpy().astype(np.uint32), rng["numpy_pos"], 0, 0.0))
    torch.set_rng_state(rng["torch"])
    s.generator.set_state(rng["loop"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


CHECKPOINT_FAILURE_LIMIT = 3  # checkpoints in a row that may fail (a full disk) before the run stops


def save(s: Session, reason: str) -> Path | None:
    """Write a checkpoint. A failed one (a full disk) is one console line and the run goes on, keeping the last
    good checkpoint; CHECKPOINT_FAILURE_LIMIT failures in a row stop the run with a sentence."""
    s.accelerator.wait_for_everyone()
    if not s.accelerator.is_main_process:
        return None
    s.run.status("saving", step=s.state.step)
    adapter = {f"{prefix}.{k}": v for prefix, module in s.trained.items()
               for k, v in lora_state_dict(s.accelerator.unwrap_model(module)).items()}
    state = {"train": s.state.as_dict(), "optimizer": s.optimizer.state_dict(),
             "lr_scheduler": s.lr_scheduler.state_dict(), "scaler": s.amp.state_dict(), "rng": rng_state(s),
             "guards": {g.name: g.state_dict() for g in s.guards}, "ema": s.ema.state_dict() if s.ema else {}}
    try:
        folder = save_checkpoint(s.run.paths.checkpoint(s.state.step), s.state.step, adapter, state)
    except CheckpointError as exc:
        s.checkpoint_failures += 1
        s.run.event("checkpoint_failed", str(exc), step=s.state.step, console=True)
        if s.checkpoint_failures >= CHECKPOINT_FAILURE_LIMIT:
            raise RunFailed(f"Stopped at step {s.state.step} because {s.checkpoint_failures} checkpoints in a row "
                            f"could not be written ({exc.reason or exc}); {last_good_sentence(s)}") from None
        s.run.status("training", step=s.state.step, max_steps=s.max_steps, error=str(exc))
        return None
    s.checkpoint_failures = 0
    protect = {s.best_checkpoint} if s.best_checkpoint else set()
    removed = prune_checkpoints(s.run.paths.checkpoints, s.config.checkpoints_total_limit, protect=protect)
    s.run.event("checkpoint", f"Saved checkpoint at step {s.state.step} ({reason}).", step=s.state.step,
                path=str(folder), removed=[str(p) for p in removed])
    return folder


def last_good_sentence(s: Session) -> str:
    """What to do after checkpoints failed, naming the last good one (lower case: it ends a sentence)."""
    from .checkpoint import list_checkpoints

    folders = list_checkpoints(s.run.paths.checkpoints)
    if not folders:
        return "free some space and start the run again (it has no checkpoint yet)."
    return f"free some space and continue with --resume auto from the last good checkpoint, {folders[-1].name}."


def resume(s: Session) -> None:
    """Continue from the checkpoint setup found (setup read and verified it before loading the model)."""
    checkpoint = s.resume_from
    if checkpoint is None:
        return
    s.resume_from = None  # its tensors are not needed once loaded
    restore_adapter(s, checkpoint.adapter)
    state = checkpoint.state
    s.optimizer.load_state_dict(state["optimizer"])
    s.lr_scheduler.load_state_dict(state["lr_scheduler"])
    s.amp.load_state_dict(state["scaler"])
    s.state = TrainState(**state["train"])
    restore_rng(s, state["rng"])
    if s.ema and state.get("ema"):
        s.ema.load_state_dict(state["ema"])
    elif s.ema:  # the checkpoint was made without EMA: average from here on
        s.ema = AdapterEMA(s.params, s.config.ema_decay, on_cpu=s.config.ema_on_cpu)
        s.run.event("config", f"{checkpoint.path.name} holds no EMA weights (ema_decay was 0 then); the EMA starts "
                    f"from the resumed weights at step {s.state.step}.", step=s.state.step, console=True)
    for guard in s.guards:
        guard.load_state_dict(state.get("guards", {}).get(guard.name, {}))
    s.run.event("resumed", f"Resumed from {checkpoint.path} at step {s.state.step} ({s.state.images_seen} images "
                f"seen, micro-batch {s.state.micro_batch_size}).", step=s.state.step, path=str(checkpoint.path),
                images_seen=s.state.images_seen)


def restore_adapter(s: Session, adapter: dict[str, torch.Tensor]) -> None:
    """Load checkpoint adapter tensors ('<prefix>.<peft key>') into the trained modules."""
    by_prefix: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in adapter.items():
        prefix, name = key.split(".", 1)
        by_prefix.setdefault(prefix, {})[name] = value
    for prefix, module in s.trained.items():
        load_lora_state_dict(s.accelerator.unwrap_model(module), by_prefix.get(prefix, {}))


# ---- export --------------------------------------------------------------------------------------------
def export(s: Session, name: str | None = None) -> Path | None:
    """The LoRA as trained, and with ema_decay its moving average beside it as NAME-ema.safetensors."""
    with evaluation_weights(s.optimizer):  # schedule-free: export the averaged weights, not the training point
        path = _export(s, name)
    if s.ema:
        with s.ema.swapped_in():
            _export(s, f"{name or s.config.output_name}-ema")
    return path


def _export(s: Session, name: str | None = None) -> Path | None:
    s.accelerator.wait_for_everyone()
    if not s.accelerator.is_main_process:
        return None
    config = s.config
    unet = s.accelerator.unwrap_model(s.trained["unet"])
    encoders = [s.accelerator.unwrap_model(s.trained[k]) for k in s.trained if k.startswith("te")]
    path = s.run.paths.output / f"{name or config.output_name}.safetensors"
    # The family knows its version strings (SD2's follow the prediction type); the run knows the rest.
    metadata = {**s.bundle.family.metadata(s.bundle), **training_metadata(s)}
    path = export_kohya_lora(path, unet, encoders, s.bundle.family, rank=config.lora_rank,
                             alpha=config.effective_lora_alpha, metadata=metadata,
                             dtype={"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.save_precision,
                                                                                       torch.float32),
                             overwrite=True)  # RUN/output is this run's own: prepare_run_dir moved any other aside
    s.run.event("exported", f"Wrote LoRA {path.name} at step {s.state.step}.", step=s.state.step, path=str(path))
    if config.export_diffusers_format:
        from ..lora.export import export_diffusers_lora

        # The run's own output folder: a later export of this run (resume, early stopping's next best)
        # replaces its earlier one, file by file through a rename, never a file outside the run.
        folder = s.run.paths.output / f"{name or config.output_name}_diffusers"
        written = export_diffusers_lora(folder, unet, encoders, s.bundle.family, overwrite=True)
        s.run.event("exported", f"Wrote diffusers-format LoRA {folder.name}/{written.name} at step {s.state.step}.",
                    step=s.state.step, path=str(written))
    return path


def training_metadata(s: Session) -> dict[str, str]:
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
        "ss_steps": str(s.state.step),
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


# ---- the loop ------------------------------------------------------------------------------------------
def train(config: TrainConfig, *, session: Session | None = None) -> Path | None:
    """Train a LoRA as `config` says and return the exported file (None on non-main processes).

    Ends `finished`, or `stopped` (the UI, early stopping, Ctrl-C / SIGTERM) after a last checkpoint and the LoRA;
    a run that cannot go on raises (RunFailed and friends) and the CLI records it as `failed` (train/outcome.py).
    """
    s = session or setup(config)
    resume(s)
    run, state = s.run, s.state
    if s.config.preflight:
        from .preflight import apply_preflight

        apply_preflight(s)
    if s.config.validation_prompts and state.step == 0 and not stop_signal(s):
        sample(s)
    run.status("training", step=state.step, max_steps=s.max_steps)
    progress = tqdm(total=s.max_steps, initial=state.step, desc="training", unit="step",
                    disable=not s.accelerator.is_main_process)
    last_time, sec_per_step = time.perf_counter(), None
    stop_reason = "finished"
    first_step = state.step
    for module in s.trained.values():
        module.train()
    for guard in s.guards:
        guard.on_start(s)
    try:  # the progress bar ends its line whatever happens, so a failure sentence starts on its own
        while state.step < s.max_steps:
            signum = stop_signal(s)
            if signum:
                if signals.ACTIVE is not None:
                    signals.ACTIVE.honoured = True
                run.event("stop", f"{signal_name(signum)} at step {state.step}; saving a checkpoint and the LoRA.",
                          step=state.step, console=True)
                stop_reason = "stopped"
                break
            batches = next_batches(s, s.config.gradient_accumulation_steps)
            s.batch_paths = [str(p) for b in batches for p in b["path"]]
            loss, grad_norm = training_step(s, batches)
            state.step += 1
            state.images_seen += global_image_count(s, batches)

            now = time.perf_counter()
            sec_per_step = (now - last_time) if sec_per_step is None else 0.9 * sec_per_step + 0.1 * (now - last_time)
            last_time = now
            metrics = dict(loss=loss, lr=s.lr_scheduler.get_last_lr()[0], grad_norm=grad_norm,
                           clip_threshold=None, epoch=state.epoch, images_seen=state.images_seen,
                           sec_per_step=sec_per_step, micro_batch_size=state.micro_batch_size)
            if s.config.reg_data_dir:
                metrics.update(s.loss_parts.means())
            verdicts = [guard.after_step(s, metrics) for guard in s.guards]
            if state.step % s.config.logging_steps == 0 or state.step == s.max_steps:
                logged = {**metrics, **memory_stats(s.device)}
                run.metric(state.step, **logged)
                if s.tensorboard:
                    s.tensorboard.log_metrics(state.step, logged)
                run.status("training", step=state.step, max_steps=s.max_steps, epoch=state.epoch,
                           sec_per_step=sec_per_step, eta_seconds=sec_per_step * (s.max_steps - state.step), loss=loss)
            progress.update(1)
            progress.set_postfix(loss=f"{loss:.4f}")
            nonfinite = s.guard("nonfinite")
            if nonfinite is not None and nonfinite.hopeless(state.step - first_step):
                raise RunFailed(nonfinite.hopeless_sentence(s, state.step - first_step))
            if s.config.validation_prompts and state.step % s.config.validation_steps == 0:
                sample(s)
            if state.step % s.config.save_steps == 0 and state.step < s.max_steps:
                save(s, "every save_steps")
            if "stop" in verdicts or obey_control(s) == "stop":
                stop_reason = "stopped"
                break
    finally:
        progress.close()
    nonfinite = s.guard("nonfinite")
    if nonfinite is not None and state.step > first_step and nonfinite.hopeless(state.step - first_step, end=True):
        raise RunFailed(nonfinite.hopeless_sentence(s, state.step - first_step))
    if state.step == first_step and stop_reason == "stopped":  # stopped before any step: nothing new to keep
        run.status("stopped", step=state.step, max_steps=s.max_steps, eta_seconds=0)
        run.event("stopped", f"Run stopped at step {state.step} before training a step; nothing new to save.",
                  step=state.step, console=True)
        return None
    save(s, stop_reason)
    final_checkpoint_failed = s.checkpoint_failures > 0
    path = export(s)
    if s.tensorboard:
        s.tensorboard.close()
    if final_checkpoint_failed:
        written = f"the LoRA was written to {path}" if path else "the LoRA was not written"
        raise RunFailed(f"The final checkpoint at step {state.step} could not be written ({written}); "
                        f"{last_good_sentence(s)}")
    summary = learning_summary(s.sample_scores) if s.sample_scores else None
    run.status(stop_reason, step=state.step, max_steps=s.max_steps, eta_seconds=0, lora=str(path) if path else None,
               summary=summary)
    run.event(stop_reason, f"Run {stop_reason} at step {state.step}.", step=state.step,
              console=stop_reason == "stopped")
    if summary:
        run.event("learning", summary, step=state.step, console=True)
    return path


def learning_summary(scores: dict[str, dict[str, float]]) -> str:
    from ..toy.judge import learning_summary as colours

    return f"Learning summary (validation images showing their colour, first -> last sampling): " \
           f"{colours(scores['first'], scores['last'])}."


def stop_signal(s: Session) -> int | None:
    """The Ctrl-C / SIGTERM the CLI caught, if any; with several processes the main one's, so every rank stops
    at the same step (a rank that stopped alone would leave the others waiting in the next collective)."""
    signum = signals.requested()
    if s.accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        signum = broadcast_object_list([signum])[0]
    return signum


def signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def sample(s: Session, *, then: str = "training") -> None:
    if not s.accelerator.is_main_process:
        return
    s.run.status("sampling", step=s.state.step, max_steps=s.max_steps)
    folder = s.run.paths.sample_dir(s.state.step)
    with evaluation_weights(s.optimizer), optional_swap(s.ema, s.config.validation_with_ema):
        paths = make_validation_images(s.bundle, s.config, folder, s.device, autocast=s.amp.autocast)
    s.run.event("samples", f"Made {len(paths)} validation images at step {s.state.step}.", step=s.state.step)
    if s.tensorboard:
        s.tensorboard.log_images(s.state.step, paths)
    if s.config.sample_judge == "toy_colors" and paths:
        from ..toy.judge import judge_samples

        scores = judge_samples(folder)
        s.sample_scores.setdefault("first", scores)
        s.sample_scores["last"] = scores
        s.run.event("sample_score", "Validation images showing their prompt's colour: " + ", ".join(
            f"{color} {value:.0%}" for color, value in scores.items()) + ".", step=s.state.step, scores=scores)
    s.run.status(then, step=s.state.step, max_steps=s.max_steps)


def sample_now(s: Session, state_after: str) -> None:
    """The UI's "Sample now". Sampling draws from its own seeded generators, never from the training RNG, so
    a run sampled on request still ends bitwise equal to one that was not."""
    if not s.config.validation_prompts:
        s.run.event("samples", "Sample now: this run has no validation prompt, so there is nothing to render "
                    "(set validation_prompt for the next run).", step=s.state.step, console=True)
        return
    sample(s, then=state_after)


def obey_control(s: Session) -> str | None:
    """Commands from the UI, between steps: save, sample, stop, pause (then wait for resume or stop)."""
    command = take_control(s)
    paused = False
    while command or paused:
        kind = (command or {}).get("command")
        if kind == "save":
            save(s, "asked from the UI")
        elif kind == "sample":
            sample_now(s, "paused" if paused else "training")
        elif kind == "stop":
            s.run.event("stop", f"Stop requested at step {s.state.step}; saving and exporting.", step=s.state.step)
            return "stop"
        elif kind == "pause" and not paused:
            paused = True
            s.run.status("paused", step=s.state.step, max_steps=s.max_steps)
            s.run.event("pause", f"Paused at step {s.state.step}.", step=s.state.step)
        elif kind == "resume" and paused:
            s.run.event("resume_run", f"Continuing from step {s.state.step}.", step=s.state.step)
            s.run.status("training", step=s.state.step, max_steps=s.max_steps)
            return None
        if paused:
            time.sleep(0.5)
            s.run.status("paused", step=s.state.step, max_steps=s.max_steps)  # keep the heartbeat fresh
        command = take_control(s)
    return None


def take_control(s: Session) -> dict[str, Any] | None:
    """The main process reads control.json; with several processes every rank must get the same command,
    or the others would train on (or wait in a save) while the main one stops."""
    command = s.run.take_control()
    if s.accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        command = broadcast_object_list([command])[0]
    return command
