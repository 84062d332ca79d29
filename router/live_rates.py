"""The rates loads and swaps are priced with, as the running engine measures them.

The start-up measurement (a probe prefill and a copy into idle pinned memory) is what a replica
can do alone; serving, its copies share the bus and the device with the steps, its prefills run
beside decodes, and a load costs its step more than its copy: the host's work to plan and issue
it, the compute stream's wait for it, the attention over a long loaded context. So three rates
move as the engine runs: the copy stream's (each finished batch of tier copies: bytes and the
copy stream's seconds); the prefill rate (each step that was mostly prefill and loaded nothing:
prompt tokens and the step's cost, workers/step_timer.py); and the loads' (each step that
loaded from the host tier: the blocks' bytes and what the step cost beyond its prompt tokens at
the prefill rate, never less than the copy itself). A load is priced at the slower of the copy
stream and the loads' rate: on a small model whose steps the host's launches bound, a load's
step costs more than recomputing its tokens would, and the loads' rate says so.
Each rate is a sum of amounts and seconds, an observation's weight halving every
``HALF_LIFE_S`` of measured time after it, the start-up figures weighing as ``PRIOR_S`` of it.

A load also waits for the loads queued before it on the copy stream (``queued_blocks``): the
time to price is theirs and its own.
"""

from dataclasses import dataclass, replace

from kvstore.transfers import StepCost
from router.kv_pricing import TransferRates

HALF_LIFE_S = 1.0  # of measured copy (prefill, loading steps') time
PRIOR_S = 0.05  # the start-up measurement's weight, in measured seconds
# the loads' rate starts at the start-up probe's (the copy's where none ran), weighing as this
# many blocks' load: a step that loads a prefix outweighs it at once (a prior of PRIOR_S at the
# copy's rate, gigabytes, would take a second of slow loads to move)
PRIOR_LOAD_BLOCKS = 16
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
        prior_bytes = PRIOR_LOAD_BLOCKS * measured.block_bytes
        load_rate = measured.load_bytes_per_s or measured.host_copy_bytes_per_s
        self.loads = RunningRate(prior_bytes, prior_bytes / load_rate)
        self.queued: dict[str, int] = {}  # blocks of each load started and not landed

    def observe_copies(self, num_bytes: int, seconds: float) -> None:
        self.copies.add(num_bytes, seconds)

    def observe_step(self, prompt_tokens: int, total_tokens: int, seconds: float) -> None:
        """A step's time counts for the prefill rate when it was mostly prompt tokens."""
        if prompt_tokens >= MIN_PREFILL_TOKENS and prompt_tokens >= MIN_PREFILL_SHARE * max(
                total_tokens, 1):
            self.prefill.add(prompt_tokens, seconds)

    def observe_step_cost(self, cost: StepCost) -> None:
        """A timed step: the loads' rate if it loaded, else the prefill rate."""
        if not cost.loaded_blocks:
            self.observe_step(cost.prompt_tokens, cost.total_tokens, cost.seconds)
            return
        num_bytes = cost.loaded_blocks * self.measured.block_bytes
        computing = cost.prompt_tokens / self.prefill.rate
        self.loads.add(num_bytes, max(cost.seconds - computing, num_bytes / self.copies.rate))

    def current(self) -> TransferRates:
        return replace(self.measured, prefill_tokens_per_s=self.prefill.rate,
                       host_copy_bytes_per_s=self.copies.rate, load_bytes_per_s=self.loads.rate)

    @property
    def queued_blocks(self) -> int:
        return sum(self.queued.values())

    def load_started(self, request_id: str, num_blocks: int) -> None:
        self.queued[request_id] = self.queued.get(request_id, 0) + num_blocks

    def load_ended(self, request_id: str) -> None:
        self.queued.pop(request_id, None)
