"""Which replica holds which prefix: a cluster-wide index built only from the replicas' events.

Each replica's engine sends the blocks entering and leaving its prefix cache as one
``EventBatch`` a step, numbered 0, 1, 2, ... within its ``epoch`` (one engine's life: a
rebuilt or restarted engine starts a new epoch with an empty cache). The directory applies the
batches in order. A gap in the numbers, or an epoch it has not seen, makes the directory ask
for that replica's ``CacheDump`` (every hash it holds, and the number of the last batch the dump
includes): it keeps the batches that come meanwhile and replays those the dump does not cover.

Lookups walk a request's chained block hashes from the first: since a hash names its whole
prefix, the longest prefix a replica holds is the count of leading hashes it holds, found in
one pass over the blocks (each step keeps the replicas still matching).
"""

from collections.abc import Container, Iterable, Mapping, Sequence
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
        """For each of ``replicas``: how many leading blocks of ``hashes`` it holds."""
        return self.matches(hashes, list(replicas))[0]

    def matches(self, hashes: Sequence[BlockHash], replicas: list[int],
                also_held: Mapping[BlockHash, Container[int]] | None = None,
                ) -> tuple[dict[int, int], dict[int, int]]:
        """Leading blocks of ``hashes`` each replica holds: as the directory lists them, and
        counting ``also_held`` (hash -> replicas about to hold it) as held too. One pass, which
        stops where no replica matches; past the first blocks usually one replica is left."""
        stored, matched = dict.fromkeys(replicas, 0), dict.fromkeys(replicas, 0)
        in_store, in_any = set(replicas), set(replicas)
        extra = also_held if also_held is not None else {}
        empty: frozenset[int] = frozenset()
        depth = 0
        while depth < len(hashes) and len(in_any) > 1:
            holders = self.holders.get(hashes[depth], empty)
            pending = extra.get(hashes[depth], empty)
            depth += 1
            in_store = {index for index in in_store if index in holders}
            in_any = {index for index in in_any if index in holders or index in pending}
            for index in in_any:
                matched[index] = depth
                if index in in_store:
                    stored[index] = depth
        if len(in_any) == 1:  # one replica left: a tight loop over the rest of the chain
            (index,) = in_any
            storing = index in in_store
            for block_hash in hashes[depth:]:
                holders = self.holders.get(block_hash, empty)
                storing = storing and index in holders
                if not storing and index not in holders and index not in extra.get(
                        block_hash, empty):
                    break
                depth += 1
                matched[index] = depth
                if storing:
                    stored[index] = depth
        return stored, matched

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
