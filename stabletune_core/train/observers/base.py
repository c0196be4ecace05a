"""Observers measure and record; they never decide anything (that is a guard's job, guards/).

An observer looks at an `ObserverView` (a few read-only numbers and handles, never the session) and returns an
`Observation`: numbers for the step's metrics (the validation loss, which the plateau and early-stopping guards
then read), events for events.jsonl, and at the end of a run a summary line; the loop writes them. An observer
may write its own files under RUN/diagnostics/ (`view.run_paths`, None on processes that write nothing).
What an observer needs beyond the view (the evaluator of the validation loss, the LPIPS term) it gets when it is
made (setup). Its `state_dict` travels in every checkpoint next to the guards'.

The loop calls, in order: `observe` once each step is counted (after the guards' `after_step`);
`on_metrics` with each metrics line it logs; `on_samples` after each set of validation images; `on_end` once,
when the run ends (finished or stopped).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Protocol

import torch

from ...runs.layout import RunPaths
from ..guards.verdicts import Event


class ObserverView(Protocol):
    """What an observer may look at. The loop's implementation reads the live session (session.SessionView)."""

    @property
    def step(self) -> int: ...  # optimizer steps taken

    @property
    def max_steps(self) -> int: ...

    @property
    def micro_batch_size(self) -> int: ...

    @property
    def run_paths(self) -> RunPaths | None: ...  # RUN/'s files on the process that writes the run, else None

    @property
    def adapters(self) -> Mapping[str, torch.nn.Module]: ...  # the modules carrying LoRA layers, unwrapped


@dataclass(frozen=True)
class Observation:
    metrics: dict[str, Any] = field(default_factory=dict)
    events: tuple[Event, ...] = ()
    summary: str | None = None  # on_end: one line for the user, also status.json's `summary`


NOTHING = Observation()


class Observer:
    name = "observer"

    def observe(self, view: ObserverView) -> Observation:
        return NOTHING

    def on_metrics(self, view: ObserverView, metrics: Mapping[str, Any]) -> Observation:
        return NOTHING

    def on_samples(self, view: ObserverView, folder: Path, paths: list[Path]) -> Observation:
        return NOTHING

    def on_end(self, view: ObserverView) -> Observation:
        return NOTHING

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
