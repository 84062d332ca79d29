"""Which replica a new request goes to. Policies are small objects over plain data.

``PrefixAffinity`` (the default) serves each request where it costs least: its prompt tokens
that replica has not cached (from the KV directory, which the replicas' own events build), plus
the prefill tokens already queued there, plus a weight times the requests decoding there. A load
guard sends the request to the least-loaded replica instead when the cheapest one has too many
more requests in flight, so one hot prefix cannot pile onto one replica while others idle; and
the hashes of requests just routed count as held there for a few seconds ("pending"), so a
burst of one group sticks together before the replica's events arrive.

A replica's prefix counts its device cache and then its host tier (the directory lists both):
host blocks there cost a load from host, priced from the measured rates. With those rates
(``set_rates``: host tiers on, several replicas) it also prices a third choice beside sending
the request where its blocks are and recomputing them elsewhere: running it on another replica
that first pulls them from the holder's host tier (kv_pricing.py), which only blocks listed in
that host tier can be. The cheapest of the three wins, the load guard still applying.
"""

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvstore.block_hash import BlockHash
from kvstore.directory import KVDirectory
from router.kv_pricing import PullChoice, TransferRates, cheapest_pull, load_tokens


@dataclass(frozen=True)
class ReplicaLoad:
    alive: bool = True
    num_requests: int = 0  # routed there and not finished
    num_prefilling: int = 0  # of which have no first token yet
    num_prefill_tokens: int = 0  # their prompt tokens not found cached when they were routed
    accepting: bool = True  # False while draining (the autoscaler removes it) and after


@dataclass(frozen=True)
class RoutingRequest:
    block_hashes: Sequence[BlockHash]  # the prompt's full blocks, as the engines hash them
    num_prompt_tokens: int
    block_size: int


@dataclass(frozen=True)
class Decision:
    replica: int
    reason: str  # affinity | no_match | load_guard | least_loaded | round_robin | pull
    cached_tokens: int = 0  # prompt tokens expected to be found cached there (or pulled)
    pull: PullChoice | None = None  # blocks to pull from another replica's host tier first


REASONS = ("affinity", "no_match", "load_guard", "least_loaded", "round_robin", "pull")


class PlacementPolicy(Protocol):
    def choose(self, loads: Sequence[ReplicaLoad], request: RoutingRequest) -> Decision:
        """The replica for a request, given every replica's load."""
        ...


def candidates(loads: Sequence[ReplicaLoad]) -> list[int]:
    """The live replicas that accept requests; all that accept when none is alive (requests
    then wait for a rebuild). A draining replica never gets a new request."""
    if not loads:
        raise ValueError("no replicas to place a request on")
    accepting = [index for index, load in enumerate(loads) if load.accepting]
    if not accepting:
        raise ValueError("no replica accepts requests: every one is draining or removed")
    alive = [index for index in accepting if loads[index].alive]
    return alive or accepting


class RoundRobin:
    def __init__(self) -> None:
        self._next = 0

    def choose(self, loads: Sequence[ReplicaLoad], request: RoutingRequest) -> Decision:
        live = candidates(loads)
        choice = live[self._next % len(live)]
        self._next += 1
        return Decision(choice, "round_robin")


class LeastLoaded:
    """The replica with the fewest requests in flight; ties go round-robin."""

    def __init__(self) -> None:
        self._next_tie = 0

    def choose(self, loads: Sequence[ReplicaLoad], request: RoutingRequest) -> Decision:
        live = candidates(loads)
        lowest = min(loads[index].num_requests for index in live)
        tied = [index for index in live if loads[index].num_requests == lowest]
        choice = tied[self._next_tie % len(tied)]
        self._next_tie += 1
        return Decision(choice, "least_loaded")


class PrefixAffinity:
    def __init__(self, directory: KVDirectory, decode_weight: float = 32.0,
                 max_imbalance: int = 16, pending_seconds: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_imbalance < 1:
            raise ValueError(f"max_imbalance must be at least 1, got {max_imbalance}")
        self.directory = directory
        self.decode_weight = decode_weight
        self.max_imbalance = max_imbalance
        self.pending_seconds = pending_seconds
        self.clock = clock
        # hash -> {replica: expiry}; the queue holds the same entries in expiry order
        self.pending: dict[BlockHash, dict[int, float]] = {}
        self._expiries: deque[tuple[float, BlockHash, int]] = deque()
        self.rates: TransferRates | None = None  # None: no pulls

    def set_rates(self, rates: TransferRates | None) -> None:
        self.rates = rates

    def choose(self, loads: Sequence[ReplicaLoad], request: RoutingRequest) -> Decision:
        live = candidates(loads)
        self._expire()
        # blocks pending on a replica count as held there (they are being computed)
        found = self.directory.matches(request.block_hashes, live, self.pending)
        most_cached = max(request.num_prompt_tokens - 1, 0)
        max_blocks = most_cached // request.block_size

        def cached(index: int) -> int:
            return min(found.matched[index] * request.block_size, most_cached)

        def cost(index: int) -> float:
            load = loads[index]
            decoding = load.num_requests - load.num_prefilling
            # blocks matched only as pending are being computed there for another request:
            # queued work this request shares (the engine lets it wait for them), not extra
            shared = (found.matched[index] - found.listed[index]) * request.block_size
            queued = max(0, load.num_prefill_tokens - shared)
            # blocks its device cache lost but its host tier kept are loaded, not recomputed
            loaded = load_tokens(self.rates, found.num_host(index, max_blocks))
            return (request.num_prompt_tokens - cached(index) + loaded + queued
                    + self.decode_weight * decoding)

        best = min(live, key=lambda index: (cost(index), loads[index].num_requests, index))
        least = min(live, key=lambda index: (loads[index].num_requests, cost(index), index))
        guarded = loads[best].num_requests - loads[least].num_requests > self.max_imbalance
        decision = Decision(least, "load_guard", cached(least)) if guarded else Decision(
            best, "affinity" if cached(best) else "no_match", cached(best))
        # a pull only to where the request may go: the chosen one's cost, or below it
        allowed = {index: cost(index) for index in live
                   if not guarded or index == least}

        def host_runs(first: int) -> dict[int, int]:
            return self.directory.host_runs(request.block_hashes, first, max_blocks, live)

        pull = cheapest_pull(self.rates, allowed, found.matched, host_runs, max_blocks,
                             request.block_size)
        if pull is not None and pull.cost < cost(decision.replica):
            pulled = (pull.first_block + pull.num_blocks) * request.block_size
            decision = Decision(pull.replica, "pull", min(pulled, most_cached), pull)
        self._add_pending(request.block_hashes, decision.replica,
                          found.listed[decision.replica])
        return decision

    def _add_pending(self, hashes: Sequence[BlockHash], replica: int, listed: int) -> None:
        """The blocks past what the directory already lists there (in either tier) count as
        held there for ``pending_seconds``: the request is computing (or pulling) them."""
        expiry = self.clock() + self.pending_seconds
        for block_hash in hashes[listed:]:
            self.pending.setdefault(block_hash, {})[replica] = expiry
            self._expiries.append((expiry, block_hash, replica))

    def _expire(self) -> None:
        now = self.clock()
        while self._expiries and self._expiries[0][0] <= now:
            expiry, block_hash, replica = self._expiries.popleft()
            entry = self.pending.get(block_hash)
            if entry is not None and entry.get(replica) == expiry:  # not renewed since
                del entry[replica]
                if not entry:
                    del self.pending[block_hash]


POLICIES = ("prefix-affinity", "least-loaded", "round-robin")


def make_policy(name: str, directory: KVDirectory) -> PlacementPolicy:
    if name == "prefix-affinity":
        return PrefixAffinity(directory)
    if name == "least-loaded":
        return LeastLoaded()
    if name == "round-robin":
        return RoundRobin()
    raise ValueError(f"unknown routing policy {name!r} (choose from {', '.join(POLICIES)})")
