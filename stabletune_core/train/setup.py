"""Set up a run: check what the user pointed at, prepare the run folder, load the model, add the adapters,
build optimizer, schedule, guards, observers and caches. Returns the `Session` the loop trains."""
from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from ..cache import cache_root
from ..config import ConfigError, TrainConfig, check_inputs
from ..data.dataset import DatasetView, EmbeddingCache, LatentCache, derive_seed, module_fingerprint
from ..data.masks import masks_note
from ..data.reg import merge_reg, scan_reg_images
from ..data.scan import scan_dataset
from ..lora.inject import adapter_mismatch, adapter_settings, add_lora, lora_parameters
from ..models.base import ModelBundle
from ..models.loading import load_model
from ..runs.earlier import earlier_run
from ..runs.reader import RunReader
from ..runs.writer import RunWriter
from . import faults
from .amp import MixedPrecision
from .checkpoint import Checkpoint, CheckpointError, latest_good_checkpoint, load_checkpoint, remove_stale_temporaries
from .diagnostics import make_observers
from .early_stopping import EarlyStoppingGuard
from .ema import AdapterEMA
from .guards import ClipGuard, Guard, MemGuard, NonFiniteGuard, PlateauGuard, PrecisionGuard, WeightNormGuard
from .optim import make_lr_scheduler, make_optimizer, optimizer_problems, unet_param_groups
from .outcome import RunFailed
from .perceptual import Perceptual, perceptual_problems
from .placement import frozen_modules_to_offload, offload
from .session import Session, TrainState
from .step import encode_pixels, encode_text
from .tensorboard import make_tensorboard_log
from .threads import set_cpu_threads
from .validation import split_validation


class RunExists(ConfigError):
    """The output folder holds an earlier run. The sentence is the failure; the earlier run's own status.json
    and events.jsonl must not be rewritten to say so (they describe that run, not this refusal)."""

    earlier_run_untouched = True



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
            checkpoint = load_checkpoint(path)
        except (CheckpointError, RuntimeError, OSError, ValueError) as exc:
            raise RunFailed(f"Cannot resume from {path}: {str(exc).rstrip('.')}. Choose another checkpoint folder, "
                            "or --resume auto for the newest good one.") from None
    else:
        parent = RunWriter(config.output_dir, enabled=False).paths.checkpoints
        bad: list[str] = []
        checkpoint = latest_good_checkpoint(parent, report=lambda message: (bad.append(message), report(message)))
        if checkpoint is None and bad and not config.allow_restart:
            raise RunFailed(f"None of the {len(bad)} checkpoints in {parent} can be read ({bad[0].split(' Falling')[0]}"
                            "); nothing was changed. Pass --allow_restart to start this run over from step 0 (the bad "
                            "checkpoints are kept), or resume from a copy of a good checkpoint.")
    if checkpoint is not None and (mismatch := adapter_mismatch(recorded_adapter_settings(checkpoint), config,
                                                                checkpoint.path.name)):
        raise ConfigError([mismatch])  # before config.toml or anything else of the run is written
    if checkpoint is not None and config.max_train_steps and checkpoint.step > config.max_train_steps:
        raise ConfigError([f"Cannot resume from {checkpoint.path.name} with max_train_steps {config.max_train_steps}: "
                           f"the run is already at step {checkpoint.step}; pass a larger max_train_steps to train on, "
                           "or export a checkpoint with `python -m stabletune_core export`."])
    return checkpoint


def recorded_adapter_settings(checkpoint: Checkpoint) -> dict[str, Any]:
    """The adapter settings a checkpoint was trained with: recorded in it, or for a checkpoint written before they
    were, those of the run's config.toml beside it (empty when it cannot be read: nothing to compare)."""
    if "adapter_settings" in checkpoint.state:
        return checkpoint.state["adapter_settings"]
    try:
        return adapter_settings(TrainConfig.from_toml(checkpoint.path.parent.parent / "config.toml"))
    except (ConfigError, OSError, ValueError):
        return {}


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

    scan = scan_dataset(Path(config.train_data_dir), config.default_caption, config.caption_extension,
                        masked_loss=config.masked_loss)
    report_skipped(run, scan.skipped, "training")
    scan, held_out = split_validation(scan, config)  # held-out images never reach the sampler
    if held_out:
        how = "validation_split empty: automatic" if config.validation_split is None else "validation_split"
        run.event("validation_split", f"Held {len(held_out)} of {len(held_out) + len(scan.items)} images out of "
                  f"training to measure validation loss on ({how}; set validation_split = 0 to train on all).",
                  held_out=[str(item.path) for item in held_out])
    if config.reg_data_dir:  # after the split: held-out images are instance images only
        reg = scan_reg_images(Path(config.reg_data_dir), scan.total_with_repeats, config.default_caption,
                              config.caption_extension, masked_loss=config.masked_loss)
        report_skipped(run, reg.skipped, "class")  # they were dropped without a word
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
    if accelerator.device.type == "cpu":  # torch's one thread per core is wrong for small models and busy machines
        threads, sentence = set_cpu_threads(bundle.unet)
        run.event("threads", sentence, console=True, threads=threads)
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
                      generator=torch.Generator().manual_seed(config.seed), weight_dtype=weight_dtype, amp=amp,
                      guards=make_guards(config), observers=make_observers(config), validation_items=held_out,
                      resume_from=resume_from)
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
    faults.arm(session)  # test-only hooks (STABLETUNE_FAULTS); installs nothing in a real run
    return session


def report_skipped(run: RunWriter, skipped: list, kind: str) -> None:
    """Every file a scan could not use as an event, and one console line for all of them."""
    for entry in skipped:
        run.event("data_skipped", f"Skipped {entry.path}: {entry.reason}", path=str(entry.path))
    if skipped:
        run.event("data_skipped", f"Skipped {len(skipped)} {kind} image(s) that cannot be used, e.g. "
                  f"{skipped[0].path.name}: {skipped[0].reason} (all listed in events.jsonl).", console=True)


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


def make_guards(config: TrainConfig) -> list[Guard]:
    """The guards a config asks for, in the order they run.

    Clipping comes first (it records the norm before the non-finite check skips anything); the plateau and
    early-stopping guards judge the validation loss, after the observers measured it (`after_measuring`).
    """
    guards: list[Guard] = [ClipGuard(config.clip_mode, config.max_grad_norm, config.clip_percentile,
                                     config.clip_window)]
    if config.oom_guard:
        guards.append(MemGuard(config.oom_retries))
    if config.nan_guard:
        guards.append(NonFiniteGuard(config.nan_window, config.nan_max_bad, config.nan_lr_factor, config.min_lr))
    if config.mixed_precision == "fp16" and config.fp16_fallback:
        guards.append(PrecisionGuard(config.fp16_max_skips))
    if config.scale_weight_norms:
        guards.append(WeightNormGuard(config.scale_weight_norms))
    if config.lr_scheduler == "plateau":
        guards.append(PlateauGuard(config.plateau_patience, config.plateau_factor, config.min_lr))
    if config.early_stopping:
        guards.append(EarlyStoppingGuard(config))
    return guards
