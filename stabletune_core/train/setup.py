"""Set up a run, read as a table of contents (`setup`): check and resolve the config, open the run, the data, the
model, the adapters, the optimizer and feed, the watchers (guards, observers, EMA). Each phase is a function that
takes the records of the phases before it and returns its own small frozen record; `session_of` wires them into the
`Session` the loop trains."""
from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from ..cache import cache_root
from ..config import ConfigError, TrainConfig, check_inputs, resolve
from ..config.families import family_defaults, family_problems, text_options
from ..data.caches import EmbeddingCache, LatentCache, module_fingerprint
from ..data.examples import DatasetView
from ..data.loader import BatchFeed
from ..data.order import BucketBatchSampler
from ..data.masks import masks_note, masks_outside_crop
from ..data.reg import merge_reg, scan_reg_images
from ..data.scan import DataItem, DatasetError, SkippedFile, scan_dataset
from ..data.seeds import derive_seed
from ..lora.inject import adapter_mismatch, adapter_settings, add_lora, lora_parameters
from ..lora.layers import run_lora_layers
from ..lora.pivotal import PivotalTokens, add_pivotal_tokens, pivotal_problems
from ..models import get_family
from ..models.base import ModelBundle, ModelFamily, Objective
from ..models.loading import family_name, load_model
from ..models.memory_plan import MemoryPlan, free_device_bytes, measured_budget, plan_memory
from ..models.quantize import quantise_linear_layers, storage_problem, stored_bytes
from ..runs import events, states
from ..runs.earlier import earlier_run
from ..runs.layout import RunPaths
from ..runs.reader import RunReader
from ..runs.writer import RunWriter
from . import faults
from .amp import MixedPrecision
from .checkpoint import Checkpoint, CheckpointError, latest_good_checkpoint, load_checkpoint, remove_stale_temporaries
from .observers.diagnostics import make_observers
from .ema import AdapterEMA
from .guards import (ClipGuard, EarlyStoppingGuard, Guard, MemGuard, NonFiniteGuard, PlateauGuard, PrecisionGuard,
                     WeightNormGuard)
from .inputs import BatchInputs
from .lr_schedule import LearningRateSchedule
from .observers.base import Observer
from .optim import make_lr_scheduler, make_optimizer, optimizer_problems, unet_param_groups
from .outcome import RunFailed
from .perceptual import Perceptual, perceptual_problems
from .placement import frozen_modules_to_offload, offload, place_denoiser, place_models
from .preview import load_preview
from .ranks import Ranks
from .observers.sample_judge import make_judge
from .session import Session
from .train_state import TrainState
from .observers.tensorboard import make_tensorboard_log
from .observers.validation_loss import Evaluator, split_validation
from .threads import set_cpu_threads


class RunExists(ConfigError):
    """The output folder holds an earlier run. The sentence is the failure; the earlier run's own status.json
    and events.jsonl must not be rewritten to say so (they describe that run, not this refusal)."""

    earlier_run_untouched = True



# ---- the run folder, the resume checkpoint ---------------------------------------------------------------------
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
    aside = writer.paths.aside(time.strftime('%Y%m%d-%H%M%S'))
    if not config.overwrite_output_dir:
        raise RunExists([f"Output folder {root} already holds an earlier run ({found}); pass --resume auto to "
                         f"continue it, choose a new --output_dir, or pass --overwrite_output_dir to move it aside "
                         f"into {aside.name}/ and start afresh."])
    if os.environ.get("RANK", "0") == "0":  # with several processes, the first one moves; nothing is deleted
        n = 2
        while aside.exists():
            aside, n = writer.paths.aside(f"{time.strftime('%Y%m%d-%H%M%S')}-{n}"), n + 1
        aside.mkdir()
        for artefact in writer.paths.artefacts:  # train.log stays: the UI's launcher holds it open for this run
            if artefact.exists():
                artefact.rename(aside / artefact.name)
        print(f"note: moved the earlier run in {root} aside into {aside.name}/ (--overwrite_output_dir).",
              file=sys.stderr)
    return writer


def draw_seed(config: TrainConfig) -> int | None:
    """Seed -1 means "random" (as in the WebUIs): a seed for `resolve` to put into the config, which is saved as the
    run's config.toml, so the run can be resumed and repeated. None when the config has its own seed."""
    if config.seed != -1:
        return None
    import secrets

    return secrets.randbelow(2**32)


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
            # a CheckpointError names the folder itself; an OSError's text would name the file again
            why = (exc.clause() if isinstance(exc, CheckpointError)
                   else f"checkpoint {path} cannot be read ({getattr(exc, 'strerror', None) or exc})")
            raise RunFailed(f"Cannot resume: {why.rstrip('.')}; choose another checkpoint folder, or --resume auto "
                            "for the newest good one.") from None
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
        return adapter_settings(TrainConfig.from_toml(RunPaths(checkpoint.path.parent.parent).config))
    except (ConfigError, OSError, ValueError):
        return {}


# ---- the table of contents ----------------------------------------------------------------------------------------
def setup(config: TrainConfig) -> Session:
    """Check everything the user pointed at (model, resume checkpoint, then the dataset) before any model loads,
    then build the run phase by phase; each phase returns a small frozen record of what it made.

    RUN/config.toml is written once the config is resolved (a random seed drawn, validation epochs counted in
    steps): exactly the config the run uses."""
    family = check(config)
    # compares with what is there as the user (or the UI) wrote it: before the family's defaults replace the SD
    # ones (a Klein run started from the UI, whose config.toml has the SD LoRA targets, was refused as "another
    # configuration" when this came after them)
    prepare_run_dir(config)
    resolved = resolve_run(config, family, measured=measured_memory(config, family), random_seed=draw_seed(config))
    opened = open_run(resolved)
    data = build_data(resolved, opened)
    config = data.config  # validation epochs counted in steps
    model = load_base_model(config, opened)
    adapters = build_adapters(config, opened, model, data)
    optimizing = build_optimizer_and_feed(config, opened, model.bundle, adapters, data)
    watchers = build_watchers(config, opened, model, adapters, optimizing, data)
    return session_of(config, opened, model, adapters, optimizing, data, watchers)


# ---- check and resolve --------------------------------------------------------------------------------------------
def check(config: TrainConfig) -> ModelFamily:
    """The config's own problems, then the detected family's (read from the checkpoint's configs or keys, nothing
    loaded yet): its knobs, then the new words against its tokenizer (files only). One ConfigError for all."""
    if problems := check_inputs(config) + perceptual_problems(config) + optimizer_problems(config):
        raise ConfigError(problems)
    name = family_name(config)
    family = get_family(name)
    if problems := family_problems(config, name) or pivotal_problems(config, family):
        raise ConfigError(problems)
    return family


def measured_memory(config: TrainConfig, family: ModelFamily) -> float | None:
    """Without vram_gb, the GiB a family with a memory plan plans for on this CUDA card (its free memory less a
    margin); None on a CPU, with vram_gb, or for a family without a memory model (SD 1.x and 2.x)."""
    if config.vram_gb or not family.plans_memory:
        return None
    return measured_budget(free_device_bytes())


@dataclass(frozen=True)
class Resolved:
    config: TrainConfig  # the family's defaults, the memory plan's knobs and the drawn seed in it
    plan: MemoryPlan | None
    measured: float | None  # the GiB the plan was made for when measured (no vram_gb)
    random_seed: int | None  # drawn for seed -1


def resolve_run(config: TrainConfig, family: ModelFamily, *, measured: float | None,
                random_seed: int | None) -> Resolved:
    """The config the run uses: the family's defaults for the knobs whose schema default is an SD family's, the memory
    plan's knobs (vram_gb, or the `measured` card), then `resolve` (the seed). Pure: reads no file, no device."""
    config = config.model_copy(update=family_defaults(config, family.name))
    plan = plan_memory(config, measured, family.name) if config.vram_gb or measured is not None else None
    if plan is not None:
        config = config.model_copy(update=plan.update)
    return Resolved(resolve(config, seed=random_seed), plan, measured, random_seed)


# ---- open the run -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Opened:
    ranks: Ranks
    amp: MixedPrecision
    run: RunWriter
    resume_from: Checkpoint | None


def open_run(resolved: Resolved) -> Opened:
    """The resume checkpoint (read and verified), the processes and precision, the run writer with what the
    user must know before anything loads (a previous process that died, bad checkpoints, the seed, the memory
    plan); then the seed is set."""
    config = resolved.config
    bad_checkpoints: list[str] = []
    resume_from = find_resume_checkpoint(config, bad_checkpoints.append)
    ranks = Ranks(Accelerator(mixed_precision="no"))  # mixed precision is ours (amp.py): the fallback switches it
    amp = MixedPrecision(config.mixed_precision, ranks.device)  # refuses a dtype the device lacks, early
    previous = RunReader(config.output_dir).status()  # read before our own heartbeat replaces it
    run = RunWriter(config.output_dir, enabled=ranks.is_main)
    run.status(states.STARTING, step=0)
    if previous.get("stale"):
        run.event(events.PREVIOUS_DIED, f"The previous process {previous.get('pid')} died at step "
                  f"{previous.get('step', 0)} (it was {previous.get('reported_state') or previous.get('state')}; "
                  "status.json went stale).", step=previous.get("step"), pid=previous.get("pid"))
    if ranks.is_main:
        for leftover in remove_stale_temporaries(run.paths.checkpoints):
            run.event(events.CHECKPOINT_BAD, f"Removed {leftover.name}: a checkpoint whose writing was interrupted.")
    for message in bad_checkpoints:
        run.event(events.CHECKPOINT_BAD, message, console=True)
    if resume_from is None and config.resume_from_checkpoint:
        run.event(events.NOTHING_TO_RESUME, "No checkpoint to resume from; starting from step 0." if not
                  bad_checkpoints else "No checkpoint could be read; starting over from step 0 (allow_restart).",
                  console=True)
    if resolved.random_seed is not None:
        run.event(events.SEED, f"Seed -1: this run uses the random seed {config.seed} (recorded in config.toml, so "
                  "--resume and a rerun with that seed repeat it).", console=True, seed=config.seed)
    if config.mixed_precision != "no" and ranks.device.type == "cpu":
        run.event(events.PRECISION, f"{config.mixed_precision} was requested but there is no GPU: the frozen model "
                  f"runs in {config.mixed_precision} on the CPU, which is slow; use mixed_precision no on a CPU.",
                  console=True)
    for note in config.notes():
        run.event(events.CONFIG, note)
    if (plan := resolved.plan) is not None:
        run.event(events.MEMORY_PLAN, plan.sentence, console=True, vram_gb=config.vram_gb or resolved.measured,
                  measured=not config.vram_gb, chosen=plan.update, estimate_bytes=plan.estimate.peak)
    if problem := storage_problem(config.base_storage, ranks.device):  # before any model loads
        raise ConfigError([problem])
    set_seed(config.seed)
    return Opened(ranks, amp, run, resume_from)


# ---- data -----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Data:
    config: TrainConfig  # resolved again with the steps per epoch (validation_epochs in steps), saved as config.toml
    view: DatasetView
    sampler: BucketBatchSampler
    held_out: list[DataItem]  # validation_split's images, never trained on
    steps_per_epoch: int


def build_data(resolved: Resolved, opened: Opened) -> Data:
    """Scan the training images (and the class images of prior preservation), hold the validation split out, say
    what was skipped or odd; then the config counted in steps is written as RUN/config.toml."""
    config, run, ranks = resolved.config, opened.run, opened.ranks
    scan = scan_dataset(Path(config.train_data_dir), config.default_caption, config.caption_extension,
                        masked_loss=config.masked_loss)
    report_skipped(run, scan.skipped, "training")
    scan, held_out = split_validation(scan, config)  # held-out images never reach the sampler
    if held_out:
        how = "validation_split empty: automatic" if config.validation_split is None else "validation_split"
        run.event(events.VALIDATION_SPLIT, f"Held {len(held_out)} of {len(held_out) + len(scan.items)} images out of "
                  f"training to measure validation loss on ({how}; set validation_split = 0 to train on all).",
                  held_out=[str(item.path) for item in held_out])
    if config.reg_data_dir:  # after the split: held-out images are instance images only
        reg = scan_reg_images(Path(config.reg_data_dir), scan.total_with_repeats, config.default_caption,
                              config.caption_extension, masked_loss=config.masked_loss)
        report_skipped(run, reg.skipped, "class")  # they were dropped without a word
        run.event(events.REG_IMAGES, f"Prior preservation: {len(reg.items)} regularisation image(s) from "
                  f"{config.reg_data_dir}, {reg.total_with_repeats} per epoch, loss weight {config.prior_loss_weight}.",
                  console=True)
        scan = merge_reg(scan, reg)
    data = DatasetView(scan, config)
    for note in data.notes:
        run.event(events.DATA, note)
    if config.masked_loss and (note := masks_note(data.items)):
        run.event(events.DATA, note)
    if outside := masks_outside_crop(data):
        refuse_or_note_masks_outside_crop(run, data, outside)
    sampler = data.sampler(config.train_batch_size)
    steps_per_epoch = math.ceil(len(sampler) / (config.gradient_accumulation_steps * ranks.count))
    config = resolve(config, seed=resolved.random_seed, steps_per_epoch=steps_per_epoch)
    if config.validation_epochs:  # diffusers' flag, in epochs: the loop counts steps
        run.event(events.CONFIG, f"validation_epochs {config.validation_epochs} = validation images every "
                  f"{config.validation_steps} steps ({steps_per_epoch} steps per epoch).")
    if ranks.is_main:
        config.save_toml(run.paths.config)
    return Data(config, data, sampler, held_out, steps_per_epoch)


# ---- the model ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BaseModel:
    bundle: ModelBundle
    objective: Objective


def load_base_model(config: TrainConfig, opened: Opened) -> BaseModel:
    """Load the family's model, say which it is, set the CPU threads for it, store its frozen weights as asked."""
    run = opened.run
    run.status(states.LOADING, step=0)
    bundle = load_model(config)
    for note in bundle.family.load_notes(bundle):  # which model this is, and a warning when it is a poor base
        run.event(events.MODEL, note, console=True, family=bundle.family.name)
    if opened.ranks.device.type == "cpu":  # torch's one thread per core is wrong for small models and busy machines
        threads, sentence = set_cpu_threads(bundle.denoiser)
        run.event(events.THREADS, sentence, console=True, threads=threads)
    objective = bundle.family.objective(bundle, config)
    store_base(bundle, config, run)
    return BaseModel(bundle, objective)


# ---- adapters -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Adapters:
    trained: dict[str, torch.nn.Module]  # modules with adapters, by checkpoint prefix (not yet accelerate-prepared)
    pivotal: PivotalTokens | None
    inputs: BatchInputs
    preview: ModelBundle | None


def build_adapters(config: TrainConfig, opened: Opened, model: BaseModel, data: Data) -> Adapters:
    """The LoRA (and pivotal tuning's new tokens) on the model, the model placed, the caches built, the adapters in
    fp32, gradient checkpointing and attention as asked, the preview model."""
    bundle, run, amp, device = model.bundle, opened.run, opened.amp, opened.ranks.device
    add_lora(bundle, config)
    pivotal = add_pivotal_tokens(bundle, config)
    swap_blocks(bundle, config, run, device, amp.weight_dtype)  # before placing: swapped weights never all go there
    place_models(bundle, device, amp.weight_dtype, config.mixed_precision, denoiser=False)
    inputs = BatchInputs(bundle, amp, device, seed=config.seed, train_text_encoder=config.train_text_encoder,
                         pivotal=pivotal)
    # the caches first: the encoders they make redundant leave the device before the denoiser comes onto it, so the
    # set-up never holds both (models/flux2_klein/memory.py counts the caching peak beside the training step's)
    build_caches(config, inputs, data.view, run, opened.ranks)
    place_denoiser(bundle, device, amp.weight_dtype)
    trained = {"unet": bundle.denoiser, **({f"te{i}": e for i, e in enumerate(bundle.text_encoders)}
                                       if config.train_text_encoder else {})}
    for module in trained.values():  # adapters train in fp32 whatever the base runs in
        for p in lora_parameters(module):
            p.data = p.data.float()
    for p in pivotal.parameters() if pivotal else []:  # the new token rows too
        p.data = p.data.float()
    if config.gradient_checkpointing:
        bundle.denoiser.enable_gradient_checkpointing()
        if config.train_text_encoder:
            for encoder in bundle.text_encoders:
                encoder.gradient_checkpointing_enable()
    enable_fast_attention(bundle, config, run)
    preview = load_preview(config, bundle, device, amp.weight_dtype) if config.preview_model else None
    if preview is not None:
        for note in preview.family.load_notes(preview)[:1]:
            run.event(events.MODEL, f"Validation images (preview_model, the trained LoRA applied): "
                      f"{note[0].lower()}{note[1:]}", console=True, family=preview.family.name, preview=True)
    if config.allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    return Adapters(trained, pivotal, inputs, preview)


# ---- optimizer and feed ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Optimizing:
    optimizer: torch.optim.Optimizer
    lr_scheduler: LearningRateSchedule
    params: list[torch.nn.Parameter]
    trained: dict[str, torch.nn.Module]  # the adapters' modules as accelerate prepared them
    max_steps: int
    feed: BatchFeed


def build_optimizer_and_feed(config: TrainConfig, opened: Opened, bundle: ModelBundle, adapters: Adapters,
                             data: Data) -> Optimizing:
    """Parameter groups (block-wise rates, the text encoders', the new tokens'), optimizer and schedule, the modules
    prepared for several processes, and the feed the steps draw their batches from."""
    run, ranks, pivotal = opened.run, opened.ranks, adapters.pivotal
    groups = unet_param_groups(bundle.denoiser, config)  # block-wise rates; a block at rate 0 is frozen
    if config.train_text_encoder:
        te_params = [p for e in bundle.text_encoders for p in lora_parameters(e)]
        groups.append({"params": te_params, "lr": config.text_encoder_lr or config.learning_rate})
    if pivotal:
        groups.append({"params": pivotal.parameters(), "lr": config.embedding_lr})
        tokens = ", ".join(f"{t.token} (from '{t.init_word}')" for t in pivotal.tokens)
        run.event(events.CONFIG, f"Pivotal tuning: training the embeddings of {tokens}, {pivotal.vectors} vector(s) "
                  f"each, at learning rate {config.embedding_lr:g}.", console=True)
    params = [p for g in groups for p in g["params"]]
    effective_batch = config.train_batch_size * config.gradient_accumulation_steps * ranks.count
    if ranks.several:
        run.event(events.PROCESSES, f"Training on {ranks.count} processes ({ranks.kind}); effective batch "
                  f"{effective_batch}.", processes=ranks.count)
    if config.scale_lr:
        for g in groups:
            g["lr"] *= effective_batch
    optimizer = make_optimizer(groups, config)
    max_steps = config.max_train_steps or config.num_train_epochs * data.steps_per_epoch
    lr_scheduler = make_lr_scheduler(optimizer, config, max_steps)
    if config.lr_warmup_steps >= max_steps and config.lr_scheduler not in ("constant", "plateau"):
        run.event(events.CONFIG, f"lr_warmup_steps ({config.lr_warmup_steps}) is not shorter than the run ({max_steps} "
                  "steps): the learning rate never reaches its peak; lower lr_warmup_steps.", console=True)
    *prepared, optimizer = ranks.prepare(*adapters.trained.values(), optimizer)
    feed = BatchFeed(data.view, data.sampler, with_pixels=adapters.inputs.latent_cache is None,
                     num_workers=config.dataloader_num_workers, world=ranks.count, rank=ranks.index,
                     pin_memory=ranks.device.type == "cuda")
    return Optimizing(optimizer, lr_scheduler, params, dict(zip(adapters.trained, prepared)), max_steps, feed)


# ---- watchers -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Watchers:
    perceptual: Perceptual | None
    evaluator: Evaluator
    observers: tuple[Observer, ...]
    guards: tuple[Guard, ...]
    ema: AdapterEMA | None
    state: TrainState
    halfway: Callable[[int], None]  # test-only: the fault harness's hook inside the checkpoint writer


def build_watchers(config: TrainConfig, opened: Opened, model: BaseModel, adapters: Adapters,
                   optimizing: Optimizing, data: Data) -> Watchers:
    """The perceptual regulariser, the evaluator, observers and guards, the EMA, the fresh training state and the
    fault harness's hooks (none in a real run)."""
    run, ranks, trained = opened.run, opened.ranks, optimizing.trained
    perceptual = None
    if config.perceptual_lambda > 0:
        perceptual = Perceptual(config, ranks.device, model.bundle, model.objective, data.view)
        run.event(events.PERCEPTUAL, perceptual.description, real_lpips=perceptual.real)
        print(perceptual.description, file=sys.stderr)
    evaluator = Evaluator(config, model.bundle, model.objective, trained, opened.amp, ranks.device, data.view,
                          data.held_out, adapters.inputs)
    observers = make_observers(config, evaluator, perceptual) + run_observers(config, run, ranks)
    state = TrainState(micro_batch_size=config.train_batch_size, resume_from=opened.resume_from)
    params = optimizing.params
    ema = AdapterEMA(params, config.ema_decay, on_cpu=config.ema_on_cpu) if config.ema_decay > 0 else None
    # test-only hooks (STABLETUNE_FAULTS); installs nothing in a real run
    halfway = faults.arm(ranks.unwrap(trained["unet"]), params, optimizing.optimizer, state)
    return Watchers(perceptual, evaluator, tuple(observers), tuple(make_guards(config)), ema, state, halfway)


# ---- the session ----------------------------------------------------------------------------------------------------
def session_of(config: TrainConfig, opened: Opened, model: BaseModel, adapters: Adapters, optimizing: Optimizing,
               data: Data, watchers: Watchers) -> Session:
    """The phases' records wired into the session (which gives the loop's hands their records: StepParts, ...)."""
    ranks, trained, max_steps = opened.ranks, optimizing.trained, optimizing.max_steps
    return Session(config=config, ranks=ranks, run=opened.run, bundle=model.bundle, objective=model.objective,
                   data=data.view, sampler=data.sampler, feed=optimizing.feed, inputs=adapters.inputs,
                   optimizer=optimizing.optimizer, lr_scheduler=optimizing.lr_scheduler, params=optimizing.params,
                   trained=trained, lora_layers=tuple(layer for _, layer in run_lora_layers(trained, ranks.unwrap)),
                   amp=opened.amp, max_steps=max_steps, state=watchers.state, guards=watchers.guards,
                   observers=watchers.observers, validation_items=data.held_out, perceptual=watchers.perceptual,
                   ema=watchers.ema, evaluator=watchers.evaluator, checkpoint_halfway=watchers.halfway,
                   preview=adapters.preview, pivotal=adapters.pivotal,
                   pivotal_freeze_step=math.ceil(config.embedding_train_fraction * max_steps))


def run_observers(config: TrainConfig, run: RunWriter, ranks: Ranks) -> list[Observer]:
    """The observers of the process that writes the run: TensorBoard (report_to) and the sample judge."""
    if not ranks.is_main:
        return []
    observers: list[Observer] = []
    log, note = make_tensorboard_log(config, run.paths)
    if note:
        run.event(events.CONFIG, note)
        print(f"note: {note}", file=sys.stderr)
    if log is not None:
        observers.append(log)
    judge = make_judge(config.sample_judge)
    if judge is not None:
        observers.append(judge)
    return observers


def refuse_or_note_masks_outside_crop(run: RunWriter, data: DatasetView, outside: list[Any]) -> None:
    """Images whose masks are white only outside their centre crop train nothing: all of them is a run whose LoRA
    stays zero (refused before the model loads); some of them, a console line."""
    if len(outside) == len(data.items):
        raise DatasetError(f"Nothing would train with masked_loss: the masks of all {len(outside)} images are white "
                           f"only outside the centre crop that trains (e.g. {outside[0].path.name}); paint white "
                           "inside the crop, turn center_crop off, or turn masked_loss off.")
    run.event(events.DATA, f"{len(outside)} image(s) train nothing: their masks are white only outside the centre "
              f"crop that trains (e.g. {outside[0].path.name}); paint white inside the crop or turn center_crop off.",
              console=True, paths=[str(item.path) for item in outside])


def report_skipped(run: RunWriter, skipped: list[SkippedFile], kind: str) -> None:
    """Every file a scan could not use as an event, and one console line for all of them."""
    for entry in skipped:
        run.event(events.DATA_SKIPPED, f"Skipped {entry.path}: {entry.reason}", path=str(entry.path))
    if skipped:
        run.event(events.DATA_SKIPPED, f"Skipped {len(skipped)} {kind} image(s) that cannot be used, e.g. "
                  f"{skipped[0].path.name}: {skipped[0].reason} (all listed in events.jsonl).", console=True)


def store_base(bundle: ModelBundle, config: TrainConfig, run: RunWriter) -> None:
    """base_storage: the denoiser's frozen Linear weights stored quantised (models/quantize.py), before the LoRA
    wraps them and before the model is placed on the device; the text encoders' too when they run every step."""
    if config.base_storage == "full":
        return
    # a text encoder that is not trained is frozen weight on the device like the denoiser: every step when it is not
    # cached, during the caching when it is (FLUX.2 Klein 9B's Qwen3-8B is 15.3 GiB in bf16, 8.8 in int8: the
    # set-up's peak on a 12 GB card)
    frozen = [bundle.denoiser] + ([] if config.train_text_encoder else list(bundle.text_encoders))
    before = sum(stored_bytes(m) for m in frozen)
    layers = sum(quantise_linear_layers(m, config.base_storage) for m in frozen)
    which = bundle.family.denoiser_name + (" and text encoder" if len(frozen) > 1 else "")
    run.event(events.PLACEMENT, f"Base storage {config.base_storage}: {layers} Linear layers of the {which} stored "
              f"quantised, {before / 2**20:.1f} MiB in fp32 -> {sum(stored_bytes(m) for m in frozen) / 2**20:.1f} "
              "MiB; the LoRA trains in fp32 on top.", console=True, base_storage=config.base_storage, layers=layers,
              text_encoders_quantised=len(frozen) > 1)


def swap_blocks(bundle: ModelBundle, config: TrainConfig, run: RunWriter, device: torch.device,
                dtype: torch.dtype) -> None:
    """blocks_to_swap: keep that many of the denoiser's blocks in CPU memory (models/block_swap.py); the swap's
    bookkeeping is kept in bundle.extra["block_swap"]."""
    if not config.blocks_to_swap:
        return
    from ..models.block_swap import BlockSwap

    blocks = bundle.family.swappable_blocks(bundle.denoiser)
    if config.blocks_to_swap > len(blocks):
        raise ConfigError([f"blocks_to_swap {config.blocks_to_swap} is more than the {len(blocks)} blocks of this "
                           f"{bundle.family.display_name} transformer; use at most {len(blocks)}."])
    bundle.extra["block_swap"] = BlockSwap.attach(blocks, config.blocks_to_swap, device, dtype)
    run.event(events.PLACEMENT, f"Block swap: {config.blocks_to_swap} of the {len(blocks)} transformer blocks stay in "
              f"CPU memory and come to {device} one at a time while they run.", console=True,
              blocks_swapped=config.blocks_to_swap, blocks=len(blocks))


def enable_fast_attention(bundle: ModelBundle, config: TrainConfig, run: RunWriter) -> None:
    """PyTorch SDPA is diffusers' default; xformers only when asked for and importable."""
    if not config.enable_xformers_memory_efficient_attention:
        return
    try:
        import xformers  # noqa: F401

        bundle.denoiser.enable_xformers_memory_efficient_attention()
        run.event(events.ATTENTION, "Using xformers memory-efficient attention.")
    except (ImportError, ValueError, NotImplementedError, RuntimeError) as exc:  # not installed, or no kernel here
        run.event(events.ATTENTION, f"xformers is not usable here ({type(exc).__name__}); using PyTorch SDPA, which "
                  "is as memory-efficient on PyTorch 2.", console=True)


def build_caches(config: TrainConfig, inputs: BatchInputs, data: DatasetView, run: RunWriter, ranks: Ranks) -> None:
    """Encode latents and caption embeddings once into `inputs`' caches; then the modules no step needs go to the
    CPU (placement.py).

    With cache_latents_to_disk the latents go to a cache shared by every run (STABLETUNE_CACHE, default
    ~/.cache/stabletune/latents), keyed by the image's bytes, its bucket and crop, and the VAE's weights and
    dtype, so a later run on the same images skips encoding. Each latent is a posterior sample seeded by its
    own pixels: the same whether this run encoded it or found it cached, and the run's RNG is not touched.
    """
    bundle = inputs.bundle
    folder = run.paths.cache if config.cache_latents_to_disk else None
    model_id = f"{Path(config.pretrained_model_name_or_path).resolve()}|{config.mixed_precision}"
    if config.cache_latents:
        run.status(states.CACHING, step=0)
        shared = cache_root() / "latents" if config.cache_latents_to_disk else None
        vae_id = f"{module_fingerprint(bundle.vae)}|{bundle.vae.dtype}" if shared else "this-run"
        inputs.latent_cache = LatentCache(shared, model_id=vae_id)

        def encode(pixels: torch.Tensor) -> torch.Tensor:
            seed = derive_seed("cached-latent", hashlib.sha256(pixels.numpy().tobytes()).hexdigest())
            return inputs.encode_pixels(pixels, torch.Generator().manual_seed(seed % 2**63))

        encoded = inputs.latent_cache.build(data, encode, disable=not ranks.is_main)
        where = f" in {shared}" if shared else ""
        run.event(events.LATENT_CACHE, f"Encoded {encoded} images and reused {inputs.latent_cache.reused} cached "
                  f"latents{where}.", encoded=encoded, reused=inputs.latent_cache.reused,
                  folder=str(shared) if shared else None)
    if config.cache_text_embeddings:
        # how the text was encoded (FLUX.2 Klein's max_sequence_length) is part of what an embedding is; only set
        # knobs, as load() receives them, so caches of runs that leave them alone keep their keys
        encoding = "".join(f"|{name}={value}" for name, value in text_options(config).items())
        inputs.text_cache = EmbeddingCache(folder / "text" if folder else None, model_id=f"{model_id}{encoding}")
        inputs.text_cache.build(data, lambda captions: inputs.encode_text(captions, grad=False),
                                disable=not ranks.is_main)
    off = frozen_modules_to_offload(bundle, config, latents_cached=inputs.latent_cache is not None,
                                    text_cached=inputs.text_cache is not None)
    if off:
        offload(off.values(), ranks.device)
        run.event(events.PLACEMENT, f"{', '.join(off)} stay on the CPU after caching: their outputs are cached, so "
                  f"only sampling brings them to {ranks.device}.", modules=list(off), device=str(ranks.device))


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
        guards.append(NonFiniteGuard.from_config(config))
    if config.mixed_precision == "fp16" and config.fp16_fallback:
        guards.append(PrecisionGuard(config.fp16_max_skips))
    if config.scale_weight_norms:
        guards.append(WeightNormGuard(config.scale_weight_norms))
    if config.lr_scheduler == "plateau":
        guards.append(PlateauGuard(config.plateau_patience, config.plateau_factor, config.min_lr))
    if config.early_stopping:
        guards.append(EarlyStoppingGuard(config))
    return guards
