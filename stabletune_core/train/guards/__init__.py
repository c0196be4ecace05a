"""Guards around the step (see base.py for when each hook runs)."""
from __future__ import annotations

from ...config import TrainConfig
from .base import Guard
from .nonfinite import NonFiniteGuard


def make_guards(config: TrainConfig) -> list[Guard]:
    """The guards a config asks for, in the order they run."""
    guards: list[Guard] = []
    if config.nan_guard:
        guards.append(NonFiniteGuard())
    return guards


__all__ = ["Guard", "make_guards"]
