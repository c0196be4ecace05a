"""Observers measure and record; they never decide anything (that is a guard's job, guards/).

After each counted step the loop asks every observer, in order, to `observe` the session; an observer writes
its own files under RUN/diagnostics/ and returns an `Observation`: numbers for the step's metrics (the
validation loss, which the plateau and early-stopping guards then read) and events for events.jsonl, which the
loop writes. An observer's `state_dict` travels in every checkpoint next to the guards'.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .guards.verdicts import Event

if TYPE_CHECKING:  # annotations only: the session module holds the observers
    from .session import Session


@dataclass(frozen=True)
class Observation:
    metrics: dict[str, Any] = field(default_factory=dict)
    events: tuple[Event, ...] = ()


NOTHING = Observation()


class Observer:
    name = "observer"

    def observe(self, s: Session) -> Observation:
        return NOTHING

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
