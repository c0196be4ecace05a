"""Ctrl-C and SIGTERM (a cloud machine being stopped) end a run cleanly.

The first signal only raises a flag: the loop finishes the step it is in, writes a checkpoint and the LoRA,
sets status.json to `stopped` and the process exits with 128 + the signal number (130 for Ctrl-C, 143 for
SIGTERM, the shell's convention, so scripts see the run was interrupted). A second Ctrl-C or SIGTERM means
"now": status.json says `stopped` with the step of the last checkpoint, and the process exits at once.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import TYPE_CHECKING, Any, Callable

from ..runs import events

if TYPE_CHECKING:  # the CLI installs the handlers before torch is imported (ranks.py imports it)
    from ..runs.writer import RunWriter
    from .ranks import Ranks

HANDLED = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Installed by the CLI around a training run; the loop polls `requested`."""

    def __init__(self, on_second: Callable[[int], None] | None = None) -> None:
        self.requested: int | None = None  # the first signal's number
        self.honoured = False  # the loop stopped because of it (a signal during the last step changes nothing)
        self.on_second = on_second
        self._previous: dict[int, Any] = {}

    def install(self) -> "StopSignals":
        for sig in HANDLED:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        """Give the signals back, except after a stop: the run is saved and the process is on its way out, so
        a further Ctrl-C must not raise KeyboardInterrupt into the interpreter's exit (a traceback)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if self.requested is None else self._exit_saved)
        self._previous.clear()

    def _exit_saved(self, signum: int, frame: Any) -> None:
        os._exit(128 + (self.requested or signum))

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is None:
            self.requested = signum
            print(f"\n{signal.Signals(signum).name} received: finishing this step, then saving a checkpoint and "
                  "the LoRA (press Ctrl-C again to quit at once without saving).", file=sys.stderr, flush=True)
            return
        if self.on_second is not None:
            self.on_second(signum)
        os._exit(128 + signum)

    @property
    def exit_code(self) -> int:
        return 128 + self.requested if self.requested and self.honoured else 0


ACTIVE: StopSignals | None = None  # set by the CLI; the loop reads it (None: nobody asked for signal handling)


def signal_name(signum: int) -> str:
    """How a user knows the signal: "Ctrl-C" for SIGINT, else its name (SIGTERM)."""
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def requested() -> int | None:
    return ACTIVE.requested if ACTIVE is not None else None


def stop_asked(ranks: Ranks, run: RunWriter, step: int) -> bool:
    """Whether the loop stops for a Ctrl-C / SIGTERM the CLI caught (with several processes the main one's, so every
    rank stops at the same step); if so the signal is marked honoured (the exit code says so) and the run says so."""
    signum = ranks.from_main(requested())
    if not signum:
        return False
    if ACTIVE is not None:
        ACTIVE.honoured = True
    run.event(events.STOP_REQUESTED, f"{signal_name(signum)} at step {step}; saving a checkpoint and the LoRA.",
              step=step, console=True)
    return True
