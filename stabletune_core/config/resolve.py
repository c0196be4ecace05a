"""The config a run actually uses: what the user left to the engine, decided. Pure, so RUN/config.toml can be
exactly the run's config and a resume or a rerun from it decides the same."""
from __future__ import annotations

from .files import TrainConfig


def resolve(config: TrainConfig, *, seed: int | None = None, steps_per_epoch: int | None = None) -> TrainConfig:
    """`config` with seed -1 ("random") replaced by `seed` (drawn by the caller) and, once the dataset's
    `steps_per_epoch` is known, validation_epochs (diffusers' flag) turned into the validation_steps the loop
    counts. A resolved config resolves to itself."""
    update = {}
    if config.seed == -1 and seed is not None:
        update["seed"] = seed
    if config.validation_epochs and steps_per_epoch is not None:
        update["validation_steps"] = config.validation_epochs * steps_per_epoch
    return config.model_copy(update=update) if update else config
