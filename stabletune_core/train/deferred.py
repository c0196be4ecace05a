"""A sampling taken at one step and made a few images at a time between later steps (issue 25.5): the first
training step does not wait for the step-0 validation images, and the charts fill while they are made. One
image every `every` steps, spread evenly over the steps before the next sampling (or the end of training):
on the toy demo an image costs about twelve training steps, so one per step would hold the first steps back
as much as making them all first did.

The images come from the adapter weights frozen when the sampling was taken (the loop swaps them in for each
image and puts the training weights back, bit for bit: `copy_` into the same parameters), and sampling draws only
from its own seeded generators, so a run that defers its images trains exactly as one that does not, and a resume
is still bitwise. The step-0 images a stopped run still owes after its resume are made with the adapters off
(samples.py `owed_base_images`): at step 0 they change nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class DeferredSampling:
    step: int  # the step whose weights the images show
    folder: Path
    weights: dict[str, torch.Tensor] | None  # the adapter tensors at `step` as the images use them; None: adapters off
    due: int  # images in all (prompts x seeds)
    every: int = 1  # steps between two images: spread over the steps before the next sampling or the end
    made: list[Path] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.made) >= self.due

    def next_images(self, count: int | None) -> list[int]:
        """The places (prompt x seed order) of the next `count` images to make; None: all that are left."""
        start = len(self.made)
        return list(range(start, self.due if count is None else min(self.due, start + count)))
