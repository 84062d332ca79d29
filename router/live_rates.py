"""The rates loads and swaps are priced with, as the running engine measures them.

The start-up measurement (a probe prefill and a copy into idle pinned memory) is what a replica
can do alone; serving, its copies share the bus and the device with the steps, and its prefills
run beside decodes. Each finished batch of tier copies (bytes and the copy stream's seconds) and
each step that was mostly prefill and loaded nothing from the host tier in it (prompt tokens
and the step's seconds: a step's loads would count as prefill time) move the rates: sums of
bytes (tokens) and seconds, each observation's weight halving every ``HALF_LIFE_S`` of measured
time after it, the start-up figures weighing as ``PRIOR_S`` of it.

A load also waits for the loads queued before it on the copy stream (``queued_blocks``): the
time to price is theirs and its own.
"""

from dataclasses import dataclass, replace

from router.kv_pricing import TransferRates

HALF_LIFE_S = 1.0  # of measured copy (or prefill) time
PRIOR_S = 0.05  # the start-up measurement's weight, in measured seconds
MIN_PREFILL_TOKENS = 64  # a step with fewer prompt tokens says little of the prefill rate
MIN_PREFILL_SHARE = 0.5  # nor does one that is mostly decodes


@dataclass
class RunningRate:
    """amount / seconds over recent observations, older ones forgotten by measured time."""

    amount: float
    seconds: float

    @classmethod
    def prior(cls, rate: float) -> "RunningRate":
        return cls(rate * PRIOR_S, PRIOR_S)

    def add(self, amount: float, seconds: float) -> None:
        if seconds <= 0 or amount < 0:
            return
        keep = 0.5 ** (seconds / HALF_LIFE_S)
        self.amount = self.amount * keep + amount
        self.seconds = self.seconds * keep + seconds

    @property
    def rate(self) -> float:
        return self.amount / self.seconds


class LiveRates:
    def __init__(self, measured: TransferRates) -> None:
        self.measured = measured
        self.copies = RunningRate.prior(measured.host_copy_bytes_per_s)
        self.prefill = RunningRate.prior(measured.prefill_tokens_per_s)
        self.queued: dict[str, int] = {}  # blocks of each load started and not landed

    def observe_copies(self, num_bytes: int, seconds: float) -> None:
        self.copies.add(num_bytes, seconds)

    def observe_step(self, prompt_tokens: int, total_tokens: int, seconds: float) -> None:
        """A step's time counts for the prefill rate when it was mostly prompt tokens."""
        if prompt_tokens >= MIN_PREFILL_TOKENS and prompt_tokens >= MIN_PREFILL_SHARE * max(
                total_tokens, 1):
            self.prefill.add(prompt_tokens, seconds)

    def current(self) -> TransferRates:
        return replace(self.measured, prefill_tokens_per_s=self.prefill.rate,
                       host_copy_bytes_per_s=self.copies.rate)

    @property
    def queued_blocks(self) -> int:
        return sum(self.queued.values())

    def load_started(self, request_id: str, num_blocks: int) -> None:
        self.queued[request_id] = self.queued.get(request_id, 0) + num_blocks

    def load_ended(self, request_id: str) -> None:
        self.queued.pop(request_id, None)
