"""A run's validation samplings: the images of a step, made at once or deferred and made a few at a time between
later steps (deferred.py), and the step-0 images a stopped run still owes after its resume.

Sampling draws only from its own seeded generators and puts the training weights back bit for bit, so a run
that samples trains exactly as one that does not. The loop decides when to sample and tells the observers about
a finished sampling; these functions make the images, with the parts they use (`Sampler`), never the session.
"""
from __future__ import annotations

import json
from contextlib import AbstractContextManager
from dataclasses import dataclass
from itertools import takewhile
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import TrainConfig
from ..lora.layers import adapters_off
from ..lora.pivotal import PivotalTokens
from ..models.base import ModelBundle
from ..runs import events
from ..runs.layout import sample_image_name, sample_prompts
from ..runs.states import SAMPLING, TRAINING
from ..runs.writer import RunWriter
from . import signals
from .control import honour_stop_while_sampling
from .deferred import DeferredSampling
from .ema import AdapterEMA, optional_swap
from .optim import evaluation_weights
from .preview import with_trained_adapters
from .ranks import Ranks
from .state import adapter_state, restore_adapter
from .train_state import TrainState
from .validation_images import image_count, make_validation_images, sample_seeds


@dataclass(frozen=True)
class Sampler:
    """What validation images are made with (the loop builds it from the session)."""

    config: TrainConfig
    run: RunWriter
    ranks: Ranks
    bundle: ModelBundle
    preview: ModelBundle | None  # preview_model: the images come from this denoiser with the trained adapters
    trained: dict[str, torch.nn.Module]
    pivotal: PivotalTokens | None
    optimizer: torch.optim.Optimizer  # a schedule-free optimizer's evaluation weights are what the images show
    ema: AdapterEMA | None
    device: torch.device
    autocast: Callable[[], AbstractContextManager[Any]]
    max_steps: int

    def sampling_bundle(self) -> ModelBundle:
        """The trained model, or the preview model carrying the adapter weights the trained one holds now."""
        return self.bundle if self.preview is None else with_trained_adapters(self.preview, self.bundle.denoiser)

    def stop_waiting(self) -> bool:
        """A stop asked for (Ctrl-C, SIGTERM, the UI) that the loop has not acted on yet. Main process only: asked
        while sampling, which only the main process does."""
        return signals.requested() is not None or self.run.stop_waiting()

    def render(self, folder: Path, only: list[int] | None = None, seeds: list[int] | None = None) -> list[Path]:
        return make_validation_images(self.sampling_bundle(), self.config, folder, self.device,
                                      autocast=self.autocast, only=only, should_stop=self.stop_waiting, seeds=seeds)

    def render_base(self, folder: Path, only: list[int] | None = None, seeds: list[int] | None = None
                    ) -> list[Path]:
        """The base model's images (the adapters switched off, the trained weights untouched)."""
        preview = () if self.preview is None else (self.preview.denoiser,)  # it carries the trained adapters
        with adapters_off((*self.trained.values(), *preview)):
            return self.render(folder, only, seeds)


@dataclass(frozen=True)
class Sampling:
    """A sampling that is over: all its images made, or fewer when a stop ended it."""

    step: int
    folder: Path
    paths: list[Path]
    due: int

    @property
    def complete(self) -> bool:
        return len(self.paths) >= self.due


#: made(sampling): the loop announces a sampling that is over and shows a complete one to the observers
Made = Callable[["Sampling"], None]


def sampling_due(step: int, every: int, max_steps: int) -> bool:
    """Validation images every `every` steps, and at the end of a run shorter than one interval: its last step
    is then the only image of the LoRA (issue 37.8)."""
    return step % every == 0 or (step == max_steps and max_steps < every)


def make_samples(sampler: Sampler, step: int, *, then: str) -> Sampling:
    """The validation images of `step` with the weights as they are now (EMA ones with validation_with_ema); a
    stop asked for meanwhile ends it at the next image. The status says `then` afterwards."""
    sampler.run.status(SAMPLING, step=step, max_steps=sampler.max_steps, sampling_step=step)
    folder = sampler.run.paths.sample_dir(step)
    seeds = sample_seeds(sampler.config, final=step == sampler.max_steps)
    with evaluation_weights(sampler.optimizer), optional_swap(sampler.ema, sampler.config.validation_with_ema):
        paths = sampler.render(folder, seeds=seeds)
    if len(seeds) > sampler.config.num_validation_images and step > 0:
        base_images_at_more_seeds(sampler, seeds)
    sampler.run.status(then, step=step, max_steps=sampler.max_steps)
    return Sampling(step, folder, paths, len(sampler.config.validation_prompts) * len(seeds))


def base_images_at_more_seeds(sampler: Sampler, seeds: list[int]) -> None:
    """final_validation_images: the base model's images at the final sampling's extra seeds, into the step-0 folder
    (which then lists every seed), so the summary measures each extra image's drift against the base's own image at
    its prompt and seed. Only beside a complete step-0 sampling; not with pivotal tuning (its new tokens' step-0
    vectors are not kept, owed_base_images)."""
    folder = sampler.run.paths.sample_dir(0)
    if sampler.pivotal is not None or not sample_prompts(folder).is_file():
        return
    made = set(json.loads(sample_prompts(folder).read_text(encoding="utf-8"))["seeds"])
    jobs = [seed for _ in sampler.config.validation_prompts for seed in seeds]  # prompt x seed order
    missing = [i for i, seed in enumerate(jobs) if seed not in made]
    if missing:
        sampler.render_base(folder, missing, seeds)


def announce(run: RunWriter, sampling: Sampling) -> None:
    """The event of a sampling that is over."""
    if sampling.complete:
        run.event(events.SAMPLES, f"Made {len(sampling.paths)} validation images at step {sampling.step}.",
                  step=sampling.step)
    else:
        run.event(events.SAMPLES, f"Made {len(sampling.paths)} of {sampling.due} validation images at step "
                  f"{sampling.step}; a stop ended the sampling.", step=sampling.step)


def take_samples(sampler: Sampler, state: TrainState, made: Made, *, then: str) -> None:
    """The validation images of this step, after the rest of a deferred sampling (samplings stay in step order);
    `made(sampling)` as each ends. A stop asked for meanwhile ends it at the next image (and this step's is not
    begun while the deferred one is unfinished)."""
    if state.deferred is None or more_deferred(sampler, state, None, made, then=then):
        made(make_samples(sampler, state.step, then=then))


# ---- deferred samplings ---------------------------------------------------------------------------------------
def defer(sampler: Sampler, step: int) -> DeferredSampling:
    """Freeze this step's adapter weights as the validation images use them, to make the images later."""
    with evaluation_weights(sampler.optimizer), optional_swap(sampler.ema, sampler.config.validation_with_ema):
        weights = adapter_state(sampler.trained, sampler.ranks, sampler.pivotal)
    return DeferredSampling(step, sampler.run.paths.sample_dir(step), weights, image_count(sampler.config),
                            every=spread(sampler.config, step, sampler.max_steps))


def spread(config: TrainConfig, step: int, max_steps: int) -> int:
    """Steps between two deferred images: the images spread over the steps before the next sampling or the end."""
    until_next = min(config.validation_steps - step % config.validation_steps, max_steps - step)
    return max(1, until_next // image_count(config))


def owed_base_images(sampler: Sampler, step: int) -> DeferredSampling | None:
    """After a resume at `step`: the step-0 images the earlier process did not make (a stop or a kill came first),
    to make between the coming steps. Step 0's adapters change nothing, so they are the base model's images: made
    with the adapters switched off, the trained weights untouched. None when nothing is owed."""
    config = sampler.config
    if not config.validation_prompts or step == 0:
        return None
    folder = sampler.run.paths.sample_dir(0)
    expected = [folder / sample_image_name(p, seed) for p in range(len(config.validation_prompts))
                for seed in sample_seeds(config)]
    made = list(takewhile(Path.is_file, expected))  # made in this order: the ones that exist lead
    if len(made) == len(expected) and sample_prompts(folder).is_file():
        return None
    if sampler.pivotal is not None:  # the new tokens' step-0 vectors are not kept: the base images cannot be made
        sampler.run.event(events.SAMPLES, f"The step-0 validation images are missing ({len(made)} of {len(expected)} "
                          "made before the resume); with pivotal tuning they cannot be made after a resume (the new "
                          "tokens' first vectors are not kept).", step=step, console=True)
        return None
    sampler.run.event(events.SAMPLES, f"The step-0 validation images are missing ({len(made)} of {len(expected)} "
                      "made before the resume); making the rest from the base model between the coming steps.",
                      step=step, console=True)
    return DeferredSampling(0, folder, None, len(expected), every=spread(config, step, sampler.max_steps),
                            made=made)


def more_deferred(sampler: Sampler, state: TrainState, count: int | None, made: Made, *,
                  then: str = TRAINING) -> bool:
    """Make `count` more of the state's deferred sampling's images (None: the rest); once it is over the deferral
    ends and `made(sampling)` says so. Returns True once all are made, False when a stop is waiting."""
    deferred = state.deferred
    if (over := make_deferred(sampler, deferred, count, step=state.step, then=then)) is not None:
        state.deferred = None
        made(over)
    return deferred.done


def end_deferred(sampler: Sampler, state: TrainState, made: Made, *, make_the_rest: bool) -> bool:
    """At the end of training: make the images still due, or, when the run stops, say how many were made.
    Returns False when a stop asked for while making them ended them (the run then ends `stopped`)."""
    deferred = state.deferred
    if not make_the_rest:
        state.deferred = None
        made(unfinished(deferred))
        return True
    if more_deferred(sampler, state, None, made):
        return True
    honour_stop_while_sampling(sampler.run, state.step, deferred.step)
    return False


def unfinished(deferred: DeferredSampling) -> Sampling:
    """A deferred sampling the run ends before all its images are made (a stop): the ones made so far."""
    return Sampling(deferred.step, deferred.folder, list(deferred.made), deferred.due)


def make_deferred(sampler: Sampler, deferred: DeferredSampling, count: int | None, *, step: int,
                  then: str) -> Sampling | None:
    """Make `count` more of a deferred sampling's images (None: the rest) with the weights it froze (none: the
    adapters off), then the training weights as they were. Returns the sampling once it is over: all made, or,
    asked for the rest, ended by a stop that is waiting."""
    sampler.run.status(SAMPLING, step=step, max_steps=sampler.max_steps, sampling_step=deferred.step)
    only = deferred.next_images(count)
    if deferred.weights is None:
        deferred.made += sampler.render_base(deferred.folder, only)
    else:
        current = adapter_state(sampler.trained, sampler.ranks, sampler.pivotal)
        restore_adapter(sampler.trained, sampler.ranks, deferred.weights, sampler.pivotal)
        try:
            deferred.made += sampler.render(deferred.folder, only)
        finally:
            restore_adapter(sampler.trained, sampler.ranks, current, sampler.pivotal)
    sampler.run.status(then, step=step, max_steps=sampler.max_steps)
    if deferred.done or (count is None and sampler.stop_waiting()):
        return unfinished(deferred)
    return None
