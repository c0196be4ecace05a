"""The LPIPS regulariser's report: the step's mean LPIPS in the metrics as `perceptual` (the loss itself stays the
diffusion loss). An observer: it only reads what the regulariser (train/perceptual.py) measured."""
from __future__ import annotations

from typing import TYPE_CHECKING

from .base import NOTHING, Observation, Observer, ObserverView

if TYPE_CHECKING:
    from ..perceptual import Perceptual


class PerceptualReport(Observer):
    """Puts the step's mean LPIPS into the metrics as `perceptual`."""

    name = "perceptual"

    def __init__(self, perceptual: Perceptual | None) -> None:
        self.perceptual = perceptual

    def observe(self, view: ObserverView) -> Observation:
        if self.perceptual is not None:
            value = self.perceptual.take_mean()
            if value is not None:
                return Observation({"perceptual": value})
        return NOTHING
