"""Guards around the step (see base.py for when each hook runs, verdicts.py for what they can decide)."""
from __future__ import annotations

from .base import Guard, GuardView, Verdicts
from .clipping import ClipGuard
from .early_stopping import EarlyStoppingGuard
from .nonfinite import NonFiniteGuard
from .out_of_memory import MemGuard, OutOfMemoryStop
from .plateau import PlateauGuard
from .precision import PrecisionGuard
from .weightnorm import WeightNormGuard

__all__ = ["ClipGuard", "EarlyStoppingGuard", "Guard", "GuardView", "MemGuard", "NonFiniteGuard", "OutOfMemoryStop",
           "PlateauGuard", "PrecisionGuard", "Verdicts", "WeightNormGuard"]
