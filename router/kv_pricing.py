"""What moving KV blocks costs against recomputing them, from rates measured at start-up.

Every choice is priced in seconds, then in prompt tokens (seconds × the prefill rate), the unit
placement costs are in (placement.py)::

    recompute   n tokens                    n / prefill_tokens_per_s
    load        b blocks host -> device     b × block_bytes / the slower of host_copy_bytes_per_s
                                            and load_bytes_per_s
    store       b blocks device -> host     b × store_seconds_per_block (the worker's copies out
                (the write-through)         and the host's work to plan them, as measured)
                (a replica's own host tier:
                blocks its device cache lost)
    pull        b blocks from a peer's      b × block_bytes / pull_bytes_per_s, then a load
                host tier, then a load
    swap        a preempted sequence's      (c + b) blocks' load:
                c missing blocks copied     c blocks copied out, b loaded back
                out, all b loaded back

Pure functions of plain numbers: the engine measures the rates, the router and the scheduler
ask these.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TransferRates:
    prefill_tokens_per_s: float  # one replica's prompt tokens per second
    host_copy_bytes_per_s: float  # device <-> host tier, one replica
    block_bytes: int  # one KV block over every shard
    pull_bytes_per_s: float = 0.0  # replica -> replica through Ray's object store; 0: none
    # a loading step's blocks over what the step cost beyond its prompt tokens (a start-up
    # probe on a GPU, workers/rate_probes.py); 0: not measured, a load costs its copy
    load_bytes_per_s: float = 0.0
    # what writing one block through to the host tier adds: a step's copies out (the start-up
    # probe) and the engine's work to plan them (measured as it runs); 0: not measured
    store_seconds_per_block: float = 0.0

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.host_copy_bytes_per_s <= 0:
            raise ValueError(f"measured rates must be positive: {self}")
        if (self.block_bytes < 1 or self.pull_bytes_per_s < 0 or self.load_bytes_per_s < 0
                or self.store_seconds_per_block < 0):
            raise ValueError(f"bad block size, pull rate or store cost: {self}")

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def load_seconds(self, num_blocks: int) -> float:
        """What loading ``num_blocks`` costs: their copy, or what a step's loads were measured
        to add to it where that is more."""
        rate = min(self.host_copy_bytes_per_s, self.load_bytes_per_s or self.host_copy_bytes_per_s)
        return num_blocks * self.block_bytes / rate

    def store_seconds(self, num_blocks: int) -> float:
        """What writing ``num_blocks`` through to the host tier costs the steps."""
        return num_blocks * self.store_seconds_per_block

    def pull_seconds(self, num_blocks: int) -> float:
        """From a peer's host tier into this replica's device cache."""
        return num_blocks * self.block_bytes / self.pull_bytes_per_s + self.load_seconds(
            num_blocks)

    def in_tokens(self, seconds: float) -> float:
        return seconds * self.prefill_tokens_per_s


def cluster_rates(measured: Sequence[TransferRates | None],
                  pull_bytes_per_s: Callable[[], float]) -> TransferRates | None:
    """The rates the router prices pulls with, over the replicas serving now: the slowest
    one's prefill, host copies and loads, and the object store's bandwidth (``pull_bytes_per_s``,
    asked only when there is something to price). None, so no pulls, below two replicas or
    when one has no host tier (nothing measured)."""
    if len(measured) < 2 or any(rates is None for rates in measured):
        return None
    known = [rates for rates in measured if rates is not None]
    probed = [rates.load_bytes_per_s for rates in known if rates.load_bytes_per_s]
    return TransferRates(min(r.prefill_tokens_per_s for r in known),
                         min(r.host_copy_bytes_per_s for r in known), known[0].block_bytes,
                         pull_bytes_per_s(), min(probed, default=0.0),
                         max(r.store_seconds_per_block for r in known))


def swap_pays(rates: TransferRates | None, num_copy_blocks: int, num_load_blocks: int,
              num_recompute_tokens: int) -> bool:
    """Whether a preempted sequence should be swapped to the host tier (its ``num_copy_blocks``
    missing there copied out, then all ``num_load_blocks`` loaded back) rather than recompute
    its ``num_recompute_tokens``. Unmeasured rates: swap (the copies run beside the steps)."""
    # a load that waits for the swap's own copies out
    return load_pays(rates, num_load_blocks, num_recompute_tokens, queued_blocks=num_copy_blocks)


def load_pays(rates: TransferRates | None, num_load_blocks: int, num_recompute_tokens: int,
              queued_blocks: int = 0) -> bool:
    """Whether loading ``num_load_blocks`` from the host tier beats recomputing their tokens,
    the load landing after the ``queued_blocks`` queued before it. Unmeasured rates: load."""
    if rates is None:
        return True
    return rates.load_seconds(queued_blocks + num_load_blocks) < rates.recompute_seconds(
        num_recompute_tokens)


# a block is written through only where storing it and loading it back once cost at most this
# share of its recompute: it is stored once for every time it may be loaded, perhaps never
WRITE_THROUGH_SHARE = 0.5


def store_pays(rates: TransferRates | None, block_size: int) -> bool:
    """Whether writing blocks through to the host tier can pay: a block's store and one load
    back must cost at most ``WRITE_THROUGH_SHARE`` of recomputing its ``block_size`` tokens.
    Where they do not (a small model, whose prefill is about as cheap as the host's work per
    block), the write-through would mostly cost the steps that carry it. Unmeasured rates:
    write through."""
    if rates is None:
        return True
    return (rates.store_seconds(1) + rates.load_seconds(1)
            <= WRITE_THROUGH_SHARE * rates.recompute_seconds(block_size))


def load_tokens(rates: TransferRates | None, num_blocks: int) -> float:
    """What loading ``num_blocks`` from a replica's own host tier costs, in prompt tokens.
    Unmeasured rates: nothing (a load is assumed to beat recomputing, as ``swap_pays`` does)."""
    return 0.0 if rates is None else rates.in_tokens(rates.load_seconds(num_blocks))


@dataclass(frozen=True)
class PullChoice:
    replica: int  # where the request runs
    source: int  # whose host tier the blocks come from
    first_block: int  # the prompt's blocks first_block .. first_block + num_blocks - 1
    num_blocks: int
    cost: float  # in prompt tokens, as placement costs are


HostRuns = Callable[[int], Mapping[int, int]]
"""For a first block: how many blocks from it on each replica's host tier lists, contiguously
(``KVDirectory.host_runs``)."""


def cheapest_pull(rates: TransferRates | None, costs: Mapping[int, float],
                  matched: Mapping[int, int], host_runs: HostRuns, max_blocks: int,
                  block_size: int) -> PullChoice | None:
    """The cheapest way to run a request on a replica that first pulls the blocks it lacks
    from another's host tier. ``costs``: each candidate's placement cost (prompt tokens, with
    what it holds already); ``matched``: the leading blocks each candidate holds or will, from
    which its pull starts. Only host-tier blocks are offered: an export reads host slots, so a
    block in a device cache alone cannot be pulled. The source is the replica whose host run
    from there is longest. None without a pull rate or when no pull saves anything."""
    if rates is None or rates.pull_bytes_per_s <= 0 or not costs:
        return None
    best: PullChoice | None = None
    for replica, cost in costs.items():
        first = matched[replica]
        if first >= max_blocks:
            continue
        runs = {index: run for index, run in host_runs(first).items() if index != replica}
        if not runs:
            continue
        source = max(runs, key=lambda index: (runs[index], -index))
        num_blocks = min(first + runs[source], max_blocks) - first
        if num_blocks <= 0:
            continue
        pulled = cost - num_blocks * block_size + rates.in_tokens(rates.pull_seconds(num_blocks))
        if best is None or pulled < best.cost:
            best = PullChoice(replica, source, first, num_blocks, pulled)
    return best
