"""`sample_judge = "toy_colors"`: an ordinary observer that measures every set of validation images with the toy
world's judge (stabletune_core/toy/judge.py, in degrees) and ends the run with a learning summary (the demo)."""
from __future__ import annotations

import importlib
from pathlib import Path

from ...runs import events
from ..guards.verdicts import Event
from ...config.judges import SAMPLE_JUDGES
from ...runs.layout import run_of_sampling
from .base import NOTHING, Observation, Observer, ObserverView


def make_judge(name: str) -> Observer | None:
    """The observer registered as `name` in config/judges.py's SAMPLE_JUDGES, imported only when a run asks for it."""
    target = SAMPLE_JUDGES[name]
    if target is None:
        return None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)()


class ToyColorJudge(Observer):
    """Measures every sampling in degrees (toy/judge.py) and ends the run with the learning summary: the
    concept's hue error against its training images, each kept colour's drift against the base's own images
    (the run's step-0 sampling, read from RUN/samples/, so a resumed run still counts from step 0), shapes."""

    name = "sample_judge"

    def __init__(self) -> None:
        self.run_dir: Path | None = None

    def on_samples(self, view: ObserverView, folder: Path, paths: list[Path]) -> Observation:
        if not paths:
            return NOTHING
        from ...toy.judge import describe, judge_samples

        self.run_dir = view.run_paths.root if view.run_paths else run_of_sampling(folder)
        measures = judge_samples(folder, self.run_dir)
        line = describe(measures)
        return Observation(events=(Event(events.SAMPLE_SCORE, f"Validation images at step {view.step}: {line}.",
                                         fields=dict(step=view.step, measures=measures, line=line)),))

    def on_end(self, view: ObserverView) -> Observation:
        run_dir = self.run_dir or (view.run_paths.root if view.run_paths else None)
        if run_dir is None:
            return NOTHING
        from ...toy.judge import learning_summary

        line = learning_summary(run_dir)
        if not line:
            return NOTHING
        summary = ("Learning summary (first -> last sampling; concept hue error against its training images, kept "
                   f"colours' drift against the base's own images at the same prompt and seed): {line}.")
        return Observation(events=(Event(events.LEARNING, summary, console=True, fields=dict(step=view.step)),),
                           summary=summary)
