"""Which replica holds which prefix: a cluster-wide index built only from the replicas' events.

Each replica's engine sends the blocks entering and leaving its prefix cache and its host tier
as one ``EventBatch`` a step, numbered 0, 1, 2, ... within its ``epoch`` (one engine's life: a
rebuilt or restarted engine starts a new epoch with empty tiers). The directory applies the
batches in order. A gap in the numbers, or an epoch it has not seen, makes the directory ask
for that replica's ``CacheDump`` (every hash each tier holds, and the number of the last batch
the dump includes): it keeps the batches that come meanwhile and replays those the dump does
not cover. The tiers are two sets, so each event only has to be in order within its tier.

Lookups walk a request's chained block hashes from the first: since a hash names its whole
prefix, the longest prefix a replica holds is the count of leading hashes it holds, found in
one pass over the blocks (each step keeps the replicas still matching). A replica's engine
finds a prompt's prefix as its device hits, then the host-tier blocks right after them, which
it loads (kvstore/kv_cache_manager.py): ``PrefixMatches`` counts both::

    blocks            0    1    2    3    4
    replica holds     D    D+H  H    H    D      (D device cache, H host tier)
    device            2                          leading device blocks
    listed            4                          ... then host ones: 2 of them loaded
    matched           5                          held in either tier (and pending ones)
"""

from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvstore.block_hash import BlockHash
from kvstore.events import DEVICE, HOST, BlockRemoved, BlockStored, KVEvent, check_tier


@dataclass(frozen=True)
class EventBatch:
    """One engine step's KV events from one replica."""

    replica: int
    epoch: str
    seq: int  # 0, 1, 2, ... within the epoch
    events: tuple[KVEvent, ...]
    created_at: float = 0.0  # the replica's clock when the step ended: the router's event lag


@dataclass(frozen=True)
class CacheDump:
    """Every block hash a replica's tiers hold, as of the batch numbered ``seq``."""

    replica: int
    epoch: str
    seq: int  # the last batch the dump includes; -1 when none was sent yet
    hashes: tuple[BlockHash, ...]  # its device prefix cache
    host_hashes: tuple[BlockHash, ...] = ()  # its host tier


@dataclass
class ReplicaView:
    epoch: str | None = None
    next_seq: int = 0
    hashes: set[BlockHash] = field(default_factory=set)  # in its device prefix cache
    host_hashes: set[BlockHash] = field(default_factory=set)  # in its host tier
    resyncing: bool = False
    waiting: list[EventBatch] = field(default_factory=list)  # arrived during a resync

    def held(self, tier: str) -> set[BlockHash]:
        return self.hashes if tier == DEVICE else self.host_hashes


@dataclass(frozen=True)
class PrefixMatches:
    """Leading blocks of a request each replica holds; device <= listed <= matched."""

    device: dict[int, int]  # in its device cache, as the directory lists them
    listed: dict[int, int]  # those, then the host-tier blocks after them (loaded there)
    matched: dict[int, int]  # held in either tier, or about to be (``also_held``)

    def num_host(self, replica: int, max_blocks: int) -> int:
        """Of the replica's first ``max_blocks`` listed blocks, those it loads from host."""
        return max(0, min(self.listed[replica], max_blocks) - self.device[replica])


class KVDirectory:
    def __init__(self, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        self.replicas = [ReplicaView() for _ in range(num_replicas)]
        self.holders: dict[BlockHash, set[int]] = {}  # device caches
        self.host_holders: dict[BlockHash, set[int]] = {}  # host tiers

    @property
    def num_blocks(self) -> int:
        """Distinct block hashes held somewhere, in either tier."""
        return len(self.holders) + sum(1 for h in self.host_holders if h not in self.holders)

    def held_by(self, replica: int, tier: str = DEVICE) -> set[BlockHash]:
        check_tier(tier)
        return set(self.replicas[replica].held(tier))

    def apply(self, batch: EventBatch) -> bool:
        """Applies a batch in its order. Returns True when the directory needs the replica's
        dump (a gap, or a new epoch): ask for it and pass it to ``resync``."""
        view = self.replicas[batch.replica]
        if view.resyncing:
            view.waiting.append(batch)
            return False
        if batch.epoch != view.epoch:  # a fresh engine: what the old one held is gone
            self._forget(batch.replica)
            view.epoch = batch.epoch
            view.next_seq = 0
        if batch.seq < view.next_seq:
            return False  # already covered (by a dump)
        if batch.seq > view.next_seq:
            view.resyncing = True
            view.waiting.append(batch)
            return True
        self._apply_events(batch.replica, batch.events)
        view.next_seq = batch.seq + 1
        return False

    def resync(self, dump: CacheDump) -> bool:
        """Replaces the replica's entries with its dump, then replays the batches that came
        after it. Returns True if those batches still leave a gap (ask again)."""
        view = self.replicas[dump.replica]
        self._forget(dump.replica)
        view.epoch, view.next_seq, view.resyncing = dump.epoch, dump.seq + 1, False
        self._add(dump.replica, dump.hashes, DEVICE)
        self._add(dump.replica, dump.host_hashes, HOST)
        # batches of another epoch are older than the dump, or belong to an engine that will
        # send more (whose next batch then shows a new epoch and asks for its own dump)
        waiting = sorted((b for b in view.waiting if b.epoch == dump.epoch), key=lambda b: b.seq)
        view.waiting = []
        for index, batch in enumerate(waiting):
            if self.apply(batch):  # still a gap: the rest wait for the next dump
                view.waiting.extend(waiting[index + 1 :])
                return True
        return False

    def add_replica(self) -> int:
        """A new replica (the cluster scaled up), holding nothing yet; its index."""
        self.replicas.append(ReplicaView())
        return len(self.replicas) - 1

    def remove_replica(self, replica: int) -> None:
        """The replica is gone (its engine died): it holds nothing until it reports again."""
        self._forget(replica)
        self.replicas[replica] = ReplicaView()

    def longest_prefixes(self, hashes: Sequence[BlockHash],
                         replicas: Iterable[int]) -> dict[int, int]:
        """For each of ``replicas``: how many leading blocks of ``hashes`` its engine finds
        (its device hits, then the host-tier blocks after them)."""
        return self.matches(hashes, list(replicas)).listed

    def matches(self, hashes: Sequence[BlockHash], replicas: list[int],
                also_held: Mapping[BlockHash, Container[int]] | None = None,
                ) -> PrefixMatches:
        """Leading blocks of ``hashes`` each replica holds (``PrefixMatches``); ``also_held``
        (hash -> replicas about to hold it) counts in ``matched`` only. One pass, which stops
        where no replica matches; past the first blocks usually one replica is left."""
        found = PrefixMatches(dict.fromkeys(replicas, 0), dict.fromkeys(replicas, 0),
                              dict.fromkeys(replicas, 0))
        in_device, in_listed, in_any = set(replicas), set(replicas), set(replicas)
        extra = also_held if also_held is not None else {}
        empty: frozenset[int] = frozenset()
        depth = 0
        while depth < len(hashes) and len(in_any) > 1:
            device = self.holders.get(hashes[depth], empty)
            host = self.host_holders.get(hashes[depth], empty)
            pending = extra.get(hashes[depth], empty)
            depth += 1
            in_device = {index for index in in_device if index in device}
            # past its device hits a replica's prefix goes on in its host tier only
            in_listed = {index for index in in_listed if index in in_device or index in host}
            in_any = {index for index in in_any
                      if index in device or index in host or index in pending}
            for index in in_any:
                found.matched[index] = depth
            for index in in_listed:
                found.listed[index] = depth
            for index in in_device:
                found.device[index] = depth
        if len(in_any) == 1:  # one replica left: a tight loop over the rest of the chain
            (index,) = in_any
            self._match_one(hashes[depth:], index, depth, found, index in in_device,
                            index in in_listed, extra)
        return found

    def _match_one(self, hashes: Sequence[BlockHash], index: int, depth: int,
                   found: PrefixMatches, on_device: bool, listed: bool,
                   extra: Mapping[BlockHash, Container[int]]) -> None:
        """``matches`` for one replica from ``depth`` on, where it matched as the flags say."""
        empty: frozenset[int] = frozenset()
        for block_hash in hashes:
            in_device = index in self.holders.get(block_hash, empty)
            in_host = index in self.host_holders.get(block_hash, empty)
            if not (in_device or in_host or index in extra.get(block_hash, empty)):
                break
            on_device = on_device and in_device
            listed = listed and (on_device or in_host)
            depth += 1
            found.matched[index] = depth
            if listed:
                found.listed[index] = depth
            if on_device:
                found.device[index] = depth

    def host_runs(self, hashes: Sequence[BlockHash], first: int, stop: int,
                  replicas: Iterable[int]) -> dict[int, int]:
        """For each of ``replicas``: how many of blocks ``first`` .. ``stop - 1`` its host tier
        lists, contiguously from ``first`` (what it can export: cluster/ray/kv_pull.py)."""
        runs = dict.fromkeys(replicas, 0)
        still = set(runs)
        empty: frozenset[int] = frozenset()
        for depth in range(first, min(stop, len(hashes))):
            still &= self.host_holders.get(hashes[depth], empty)
            if not still:
                break
            for index in still:
                runs[index] = depth + 1 - first
        return runs

    def _apply_events(self, replica: int, events: Iterable[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._add(replica, (event.block_hash,), event.tier)
            elif isinstance(event, BlockRemoved):
                self._discard(replica, event.block_hash, event.tier)

    def _tier_holders(self, tier: str) -> dict[BlockHash, set[int]]:
        return self.holders if tier == DEVICE else self.host_holders

    def _add(self, replica: int, hashes: Iterable[BlockHash], tier: str) -> None:
        held, holders = self.replicas[replica].held(tier), self._tier_holders(tier)
        for block_hash in hashes:
            held.add(block_hash)
            holders.setdefault(block_hash, set()).add(replica)

    def _discard(self, replica: int, block_hash: BlockHash, tier: str) -> None:
        self.replicas[replica].held(tier).discard(block_hash)
        tier_holders = self._tier_holders(tier)
        holders = tier_holders.get(block_hash)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del tier_holders[block_hash]

    def _forget(self, replica: int) -> None:
        for tier in (DEVICE, HOST):
            for block_hash in list(self.replicas[replica].held(tier)):
                self._discard(replica, block_hash, tier)

    def check_integrity(self) -> None:
        """Both indexes of each tier agree: each replica's hashes are exactly those listing
        it."""
        for tier in (DEVICE, HOST):
            tier_holders = self._tier_holders(tier)
            for index, view in enumerate(self.replicas):
                listed = {h for h, holders in tier_holders.items() if index in holders}
                assert listed == view.held(tier), (
                    f"replica {index}: {tier} holders and hashes disagree")
            assert all(tier_holders.values()), f"an empty {tier} holder set was left behind"
