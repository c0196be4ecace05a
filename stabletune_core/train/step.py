"""The work of one optimizer step, with the pieces it uses as arguments: the next batches, forward and backward
over micro-batches (one loss for every image of the step, on every process), and gradient clipping. The loop
(loop.py `training_step`) puts them together and asks the guards in between."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..data.loader import BatchFeed
from ..data.masks import batch_loss_mask
from ..lora.pivotal import PivotalTokens
from ..models.base import Objective
from ..runs import events
from ..runs.image_losses import loss_record
from ..runs.writer import RunWriter
from .amp import MixedPrecision
from .forward import predict_and_loss, weigh
from .inputs import BatchInputs
from .loss import LossParts, prior_weights
from .noise import NoiseOptions, noised
from .perceptual import Perceptual
from .ranks import Ranks
from .train_state import TrainState


def next_batches(feed: BatchFeed, state: TrainState, count: int) -> list[dict[str, Any]]:
    """This process's share of the next `count` x processes sampler batches; moves the data position.

    Every process walks the same global order and takes every world-th batch, so the global batch of a step
    is the same whatever the number of processes (data/loader.py `BatchFeed`, whose workers decode the next
    batches while this step runs).
    """
    batches = feed.take((state.epoch, state.batch_in_epoch), count)
    state.epoch, state.batch_in_epoch = feed.position
    return batches


def micro_chunks(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


@dataclass(frozen=True)
class StepLoss:
    mean: float  # over every image of the step, on every process
    parts: dict[str, float] = field(default_factory=dict)  # instance / prior images' unweighted means (reg_data_dir)
    # this process's images, in order, with their loss before any weighting, timestep and whether it is a class
    # image: the doctor's per-image ranking (tools/image_losses.py)
    per_image: PerImageLosses | None = None


@dataclass(frozen=True)
class PerImageLosses:
    paths: list[str]
    losses: list[float]
    timesteps: list[float]
    reg: list[bool]

    def record(self, step: int) -> dict[str, Any]:
        """The run folder's per-image loss record of optimizer step `step` (runs/image_losses.py)."""
        return loss_record(step, self.paths, self.losses, self.timesteps, self.reg)


def freeze_embeddings(pivotal: PivotalTokens | None, run: RunWriter, step: int, freeze_step: int,
                      fraction: float) -> None:
    """Pivotal tuning: from `freeze_step` on (embedding_train_fraction of the run) the new token rows get no
    gradient, so they stay bitwise as they are while the LoRA goes on learning around them. A resumed run past that
    step freezes them before its first step, as the uninterrupted run did."""
    if pivotal is None or not pivotal.training or step < freeze_step:
        return
    pivotal.set_training(False)
    run.event(events.CONFIG, f"Pivotal tuning: the new token embeddings freeze at step {step} "
              f"(embedding_train_fraction {fraction:g}); the LoRA trains on.", step=step, console=True)


@dataclass(frozen=True)
class StepParts:
    """What one step's forward and backward use: fixed for the run, built once by setup."""

    inputs: BatchInputs  # a batch's latents and conditioning (caches or encoders)
    objective: Objective  # the family's: timesteps, noising, target, loss weights, the denoiser call
    denoiser: torch.nn.Module  # the trained denoiser as the step calls it (accelerate's wrapper with several ranks)
    trained: dict[str, torch.nn.Module]  # modules with adapters, by checkpoint prefix
    params: list[torch.nn.Parameter]
    amp: MixedPrecision
    ranks: Ranks
    noise: NoiseOptions
    masked_loss: bool
    prior_loss_weight: float
    perceptual: Perceptual | None = None


def forward_backward(batches: list[dict[str, Any]], parts: StepParts, *, micro_batch_size: int,
                     step: int = 0) -> StepLoss:
    """Mean loss over every image of one optimizer step (all processes), gradients accumulated. `step`: the
    optimizer steps taken before this one.

    Noise and timesteps are drawn per sampler batch before it is split into micro-batches, so shrinking the
    micro-batch after an OOM changes nothing but memory use; they come from the batch's own generator, so they
    do not depend on the number of processes either. The gradient is the mean over every image of the step on
    every process, however unevenly the images are spread over ranks.

    With several processes nothing here talks to the other ranks while a rank computes (no DDP hook fires in
    a backward): each phase ends in one all-reduce that also says whether any rank ran out of memory, so every
    rank retries (or goes on) together instead of hanging in a collective that the failed rank never reaches.
    """
    inputs, objective, denoiser, amp, ranks = parts.inputs, parts.objective, parts.denoiser, parts.amp, parts.ranks
    perceptual = parts.perceptual
    images = sum(len(b["caption"]) for b in batches)
    work, perceptual_count, failure = [], 0, None
    try:
        for batch in batches:
            latents = inputs.latents(batch)
            # masked loss: None when masks are off or no image of the batch has one
            mask = batch_loss_mask(batch, latents.shape[-2:]) if parts.masked_loss else None
            noisy, drawn, timesteps = noised(objective, latents, inputs.generator(batch), parts.noise)
            target = objective.target(latents, drawn, timesteps)
            # The LPIPS rows are chosen per sampler batch, so micro-batching cannot change who gets the term.
            chosen = perceptual.chosen_rows(step, timesteps) if perceptual else []
            perceptual_count += len(chosen)
            for rows in micro_chunks(len(batch["caption"]), micro_batch_size):
                work.append((batch, rows, noisy, target, timesteps, mask,
                             [i for i in chosen if rows.start <= i < rows.stop]))
    except torch.cuda.OutOfMemoryError as exc:
        if not ranks.several:
            raise
        failure = (str(exc).splitlines() or ["CUDA out of memory"])[0]
    if ranks.several:
        images, perceptual_count = (int(n) for n in ranks.agree([images, perceptual_count], failure))
    loss_sum = torch.zeros((), device=ranks.device)
    loss_parts = LossParts()
    raw_losses, drawn_at, paths, regs = [], [], [], []
    try:
        with ranks.no_sync(parts.trained.values()):  # with several processes, gradients are summed once, below
            for batch, rows, noisy, target, timesteps, mask, chosen in work:
                cond = inputs.conditioning(batch, rows)
                pred, raw = predict_and_loss(objective, denoiser, noisy[rows], target[rows], timesteps[rows], cond,
                                             dtype=amp.weight_dtype, autocast=amp.autocast,
                                             mask=None if mask is None else mask[rows])
                per_sample = weigh(objective, raw, timesteps[rows])  # the raw loss is kept per image, below
                is_reg = batch["is_reg"][rows]
                raw_losses.append(raw.detach())
                drawn_at.append(timesteps[rows].detach())
                paths += [str(p) for p in batch["path"][rows]]
                regs += [bool(r) for r in is_reg]
                loss_parts.add(per_sample, is_reg)
                loss = (per_sample * prior_weights(is_reg, parts.prior_loss_weight, per_sample.device)).sum()
                objective_value = loss / images
                if chosen:  # joins the gradients as lambda x the step's mean LPIPS, not the reported loss
                    objective_value = objective_value + perceptual.term(batch, rows, chosen, pred, noisy[rows],
                                                                        timesteps[rows]) / perceptual_count
                ranks.backward(amp.scale(objective_value))
                loss_sum += loss.detach().float()  # no .item() here: one device sync per step, not per micro-batch
    except torch.cuda.OutOfMemoryError as exc:
        if not ranks.several:
            raise
        failure = (str(exc).splitlines() or ["CUDA out of memory"])[0]
    if ranks.several:
        (loss_sum,) = ranks.agree([loss_sum], failure)
        ranks.sum_gradients(parts.params)
    per_image = PerImageLosses(paths, torch.cat(raw_losses).float().tolist(),
                               torch.cat(drawn_at).float().tolist(), regs) if raw_losses else None
    return StepLoss(float(loss_sum) / images, loss_parts.means(), per_image)


def nonfinite_gradients(trained: dict[str, torch.nn.Module]) -> list[str]:
    """Names of the trained tensors whose gradient holds NaN or Inf (only computed on a bad step)."""
    names = []
    for prefix, module in trained.items():
        for name, p in module.named_parameters():
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                names.append(f"{prefix}.{name}")
    return names


def clip_gradients(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, amp: MixedPrecision,
                   max_norm: float) -> float:
    """Clip to `max_norm` (inf = no clipping); returns the norm before clipping.

    A non-finite norm leaves the gradients as they are, so the non-finite guard can name the bad tensors.
    """
    amp.unscale_(optimizer)  # fp16: clip and check the true gradients, not the scaled ones
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if math.isfinite(max_norm) and torch.isfinite(norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return float(norm)
