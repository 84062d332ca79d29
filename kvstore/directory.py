"""Which replica holds which prefix: a cluster-wide index built only from the replicas' events.

Each replica's engine sends the blocks entering and leaving its prefix cache as one
``EventBatch`` a step, numbered 0, 1, 2, ... within its ``epoch`` (one engine's life: a
rebuilt or restarted engine starts a new epoch with an empty cache). The directory applies the
batches in order. A gap in the numbers, or an epoch it has not seen, makes the directory ask
for that replica's ``CacheDump`` (every hash it holds, and the number of the last batch the dump
includes): it keeps the batches that come meanwhile and replays those the dump does not cover.

Lookups walk a request's chained block hashes from the first: since a hash names its whole
prefix, the longest prefix a replica holds is the count of leading hashes it holds, found in
one pass over the blocks (each step intersects the set of replicas still matching).
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvstore.block_hash import BlockHash
from kvstore.events import BlockRemoved, BlockStored, KVEvent


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
    """Every block hash a replica's cache holds, as of the batch numbered ``seq``."""

    replica: int
    epoch: str
    seq: int  # the last batch the dump includes; -1 when none was sent yet
    hashes: tuple[BlockHash, ...]


@dataclass
class ReplicaView:
    epoch: str | None = None
    next_seq: int = 0
    hashes: set[BlockHash] = field(default_factory=set)
    resyncing: bool = False
    waiting: list[EventBatch] = field(default_factory=list)  # arrived during a resync


class KVDirectory:
    def __init__(self, num_replicas: int) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        self.replicas = [ReplicaView() for _ in range(num_replicas)]
        self.holders: dict[BlockHash, set[int]] = {}

    @property
    def num_blocks(self) -> int:
        """Distinct block hashes held somewhere."""
        return len(self.holders)

    def held_by(self, replica: int) -> set[BlockHash]:
        return set(self.replicas[replica].hashes)

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
        self._add(dump.replica, dump.hashes)
        # batches of another epoch are older than the dump, or belong to an engine that will
        # send more (whose next batch then shows a new epoch and asks for its own dump)
        waiting = sorted((b for b in view.waiting if b.epoch == dump.epoch), key=lambda b: b.seq)
        view.waiting = []
        for index, batch in enumerate(waiting):
            if self.apply(batch):  # still a gap: the rest wait for the next dump
                view.waiting.extend(waiting[index + 1 :])
                return True
        return False

    def remove_replica(self, replica: int) -> None:
        """The replica is gone (its engine died): it holds nothing until it reports again."""
        self._forget(replica)
        self.replicas[replica] = ReplicaView()

    def longest_prefixes(self, hashes: Sequence[BlockHash],
                         replicas: Iterable[int]) -> dict[int, int]:
        """For each of ``replicas``: how many leading blocks of ``hashes`` it holds."""
        matched = dict.fromkeys(replicas, 0)
        candidates = set(matched)
        for depth, block_hash in enumerate(hashes):
            candidates &= self.holders.get(block_hash, set())
            if not candidates:
                break
            for replica in candidates:
                matched[replica] = depth + 1
        return matched

    def _apply_events(self, replica: int, events: Iterable[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._add(replica, (event.block_hash,))
            elif isinstance(event, BlockRemoved):
                self._discard(replica, event.block_hash)

    def _add(self, replica: int, hashes: Iterable[BlockHash]) -> None:
        held = self.replicas[replica].hashes
        for block_hash in hashes:
            held.add(block_hash)
            self.holders.setdefault(block_hash, set()).add(replica)

    def _discard(self, replica: int, block_hash: BlockHash) -> None:
        self.replicas[replica].hashes.discard(block_hash)
        holders = self.holders.get(block_hash)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self.holders[block_hash]

    def _forget(self, replica: int) -> None:
        for block_hash in list(self.replicas[replica].hashes):
            self._discard(replica, block_hash)

    def check_integrity(self) -> None:
        """Both indexes agree: each replica's hashes are exactly those listing it."""
        for index, view in enumerate(self.replicas):
            listed = {h for h, holders in self.holders.items() if index in holders}
            assert listed == view.hashes, f"replica {index}: holders and hashes disagree"
        assert all(self.holders.values()), "an empty holder set was left behind"
