"""Guards around the step (see base.py for when each hook runs)."""
from __future__ import annotations

from ...config import TrainConfig
from .base import Guard
from .clipping import ClipGuard
from .lr import PlateauGuard
from .memory import MemGuard, OutOfMemoryStop
from .nonfinite import NonFiniteGuard
from .precision import PrecisionGuard
from .weightnorm import WeightNormGuard


def make_guards(config: TrainConfig) -> list[Guard]:
    """The guards a config asks for, in the order they run.

    Clipping comes first (it records the norm before the non-finite check skips anything); the plateau guard
    comes last because it reads the validation loss other guards put into the step's metrics.
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
    from ..diagnostics import measuring_guards  # issue 5: validation loss, LPIPS report, spectra, activations

    guards += measuring_guards(config)  # validation loss lands in the metrics before plateau/early stop read it
    if config.lr_scheduler == "plateau":
        guards.append(PlateauGuard(config.plateau_patience, config.plateau_factor, config.min_lr))
    if config.early_stopping:
        from ..early_stopping import EarlyStoppingGuard

        guards.append(EarlyStoppingGuard(config))
    return guards


__all__ = ["ClipGuard", "Guard", "MemGuard", "NonFiniteGuard", "OutOfMemoryStop", "PlateauGuard", "PrecisionGuard",
           "WeightNormGuard", "make_guards"]
