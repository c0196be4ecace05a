"""`sample_judge = "toy_colors"`: an ordinary observer that scores every set of validation images with the toy
world's colour judge (stabletune_core/toy/judge.py) and ends the run with a learning summary (the demo)."""
from __future__ import annotations

import importlib
from pathlib import Path

from ...runs import events
from ..guards.verdicts import Event
from .judges import SAMPLE_JUDGES
from .base import NOTHING, Observation, Observer, ObserverView


def make_judge(name: str) -> Observer | None:
    """The observer registered as `name` in judges.SAMPLE_JUDGES, imported only when a run asks for it."""
    target = SAMPLE_JUDGES[name]
    if target is None:
        return None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)()


class ToyColorJudge(Observer):
    name = "sample_judge"

    def __init__(self) -> None:
        self.first: dict[str, float] | None = None  # the first and the last sampling's scores, for the summary
        self.last: dict[str, float] | None = None

    def on_samples(self, view: ObserverView, folder: Path, paths: list[Path]) -> Observation:
        if not paths:
            return NOTHING
        from ...toy.judge import judge_samples

        scores = judge_samples(folder)
        if self.first is None:  # after a resume too, the summary counts from the run's step-0 images (issue 25.9)
            step0 = view.run_paths.sample_dir(0) if view.run_paths else folder
            self.first = judge_samples(step0) if step0 != folder and any(step0.glob("*.png")) else scores
        self.last = scores
        return Observation(events=(Event(events.SAMPLE_SCORE, "Validation images showing their prompt's colour: " +
                                         ", ".join(f"{color} {value:.0%}" for color, value in scores.items()) + ".",
                                         fields=dict(step=view.step, scores=scores)),))

    def on_end(self, view: ObserverView) -> Observation:
        if self.last is None:
            return NOTHING
        from ...toy.judge import learning_summary

        summary = (f"Learning summary (validation images showing their colour, first -> last sampling): "
                   f"{learning_summary(self.first, self.last)}.")
        return Observation(events=(Event(events.LEARNING, summary, console=True, fields=dict(step=view.step)),),
                           summary=summary)
