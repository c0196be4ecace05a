"""The pieces of one optimizer step: the next batches, their latents and conditioning, forward and backward
over micro-batches (summed across processes), and gradient clipping. The loop (loop.py) puts them together."""
from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from ..data.dataset import BatchFeed, derive_seed
from ..data.masks import batch_loss_mask
from ..models.base import Conditioning
from .forward import predict_and_loss
from .loss import prior_weights
from .noise import NoiseOptions, noised
from .session import Session


@torch.no_grad()
def encode_pixels(s: Session, pixels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return s.bundle.family.encode_latents(s.bundle, pixels, generator=generator)


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
            noisy, noise, timesteps = noised(s.objective, latents, noise_generator(s, batch),
                                             NoiseOptions.from_config(s.config))
            target = s.objective.target(latents, noise, timesteps)
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
                mask = batch["latent_mask"]
                pred, per_sample = predict_and_loss(s.objective, unet, noisy[rows], target[rows], timesteps[rows],
                                                    cond, dtype=s.weight_dtype, autocast=s.amp.autocast,
                                                    weighted=True, mask=None if mask is None else mask[rows])
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
