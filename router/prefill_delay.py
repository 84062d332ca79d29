"""vLLM's ``scheduler_delay_factor``: new prompts wait a little so that more of them batch.

While sequences are running, waiting prompts are admitted only once the oldest of them has
waited ``factor`` times the time the last step took (measured between schedule calls): a burst
of arrivals then prefills together in one step instead of one step each, each of which would
also slow every running decode. With nothing running, nothing waits. A factor of 0 is off.
"""

import time
from collections.abc import Callable


class PrefillDelay:
    def __init__(self, factor: float, clock: Callable[[], float] = time.monotonic) -> None:
        if factor < 0:
            raise ValueError(f"scheduler_delay_factor must be >= 0, got {factor}")
        self.factor = factor
        self.clock = clock
        self.last_schedule: float | None = None
        self.last_step_s = 0.0

    def admits(self, oldest_arrival: float | None, any_running: bool) -> bool:
        """Whether waiting prompts may be admitted now; call once per schedule."""
        now = self.clock()
        if self.last_schedule is not None:
            self.last_step_s = now - self.last_schedule
        self.last_schedule = now
        if self.factor == 0 or not any_running or oldest_arrival is None:
            return True
        return now - oldest_arrival >= self.factor * self.last_step_s
