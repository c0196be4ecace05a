"""Guards around the step (see base.py for when each hook runs, verdicts.py for what they can decide)."""
from __future__ import annotations

from .base import Guard, GuardView, Verdicts
from .clipping import ClipGuard
from .lr import PlateauGuard
from .memory import MemGuard, OutOfMemoryStop
from .nonfinite import NonFiniteGuard
from .precision import PrecisionGuard
from .weightnorm import WeightNormGuard

__all__ = ["ClipGuard", "Guard", "GuardView", "MemGuard", "NonFiniteGuard", "OutOfMemoryStop", "PlateauGuard",
           "PrecisionGuard", "Verdicts", "WeightNormGuard"]
