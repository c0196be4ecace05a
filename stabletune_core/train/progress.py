"""The run's pace as the loop shows it: the console's progress bar, the seconds per step (a moving average) and when
status.json's heartbeat is due. Nothing here reads or changes the model; it only keeps time."""
from __future__ import annotations

import math
import time

from tqdm.auto import tqdm

#: status.json while training is rewritten at most this often: the UI polls it about once a second, and a
#: fast step would otherwise spend more on the heartbeat than on all the guards together (bench/RESULTS.md).
HEARTBEAT_SECONDS = 0.5


class Pace:
    """The progress bar from `step` to `max_steps`, the step time and the heartbeat's clock."""

    def __init__(self, step: int, max_steps: int, *, shown: bool) -> None:
        self.bar = tqdm(total=max_steps, initial=step, desc="training", unit="step", disable=not shown)
        self.last_time, self.sec_per_step = time.perf_counter(), None
        self.last_heartbeat = -math.inf

    def step_done(self) -> float:
        """A step is counted: returns the seconds per step (the first step's own, then a moving average)."""
        self.now = time.perf_counter()
        took = self.now - self.last_time
        self.sec_per_step = took if self.sec_per_step is None else 0.9 * self.sec_per_step + 0.1 * took
        self.last_time = self.now
        return self.sec_per_step

    def heartbeat_due(self, *, last_step: bool) -> bool:
        """Whether status.json is to be rewritten now (at most every HEARTBEAT_SECONDS, and after the last step)."""
        if self.now - self.last_heartbeat >= HEARTBEAT_SECONDS or last_step:
            self.last_heartbeat = self.now
            return True
        return False

    def show(self, loss: float) -> None:
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.4f}")

    def close(self) -> None:
        self.bar.close()
