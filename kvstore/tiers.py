"""The tiers below the device pool, and the copies between them that each step carries.

One block, one hash, wherever it lives: the GPU pool, the host tier and the disk tier hold the
same block under the same chained hash. This manager decides the copies; the workers do them
(``transfers.py`` says in which order)::

    write-through   a block entering the device prefix cache is copied to the host tier,
                    after the next step's forward (before it, if the pool hands its block out
                    again in that step); while ``write_through`` is off (the engine turns it
                    off where loading a block back saves too little against recomputing it),
                    only the blocks of one request in ``WRITE_PROBE_EVERY`` (by its id), so
                    that loads are still measured
    demotion        a block evicted from the host tier is written to disk, if it is not there
    disk eviction   a block evicted from disk whose file this process wrote is deleted by
                    the workers, after that write (``DiskTier.take_deletes``)
    swap-out        a preempted sequence's blocks missing from the host tier go there too, so
                    it resumes from them instead of recomputing
    load            a waiting sequence's prefix, continued past the device hits into the host
                    tier and then disk (contiguous blocks only), comes back into fresh device
                    blocks while the sequence waits and others run; disk blocks pass through a
                    host slot (and so stay in the host tier)

    export          the host-tier blocks of a prefix, read by every shard for another
                    replica (through Ray's object store); pinned until the reads are done
    import          blocks another replica exported, staged in each shard, written into
                    host slots by the next step: then they are ordinary host-tier blocks

A block is pinned in every tier it is read from while its load is under way. A load's report
(``TransferReport``) unpins it; a disk read that failed removes the block from both tiers, and
the tokens it held are recomputed.
"""

import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.block_hash import BlockHash
from kvstore.block_pool import BlockPool, KVBlock
from kvstore.disk_tier import DiskTier
from kvstore.events import HOST
from kvstore.host_tier import HostBlock, HostTier
from kvstore.transfers import (
    BlockLoad,
    DiskRead,
    DiskWrite,
    HostImport,
    KVTransfers,
    TransferReport,
)

DISK = "disk"  # HOST comes from events.py: the host tier's blocks are KV events too
WRITE_PROBE_EVERY = 16  # with the write-through off, a request in so many is written anyway


def writes_anyway(request_id: str) -> bool:
    """Whether a request's blocks are written through while the write-through is off: a
    stable choice (a checksum of its id), the same for every block of it."""
    return zlib.crc32(request_id.encode()) % WRITE_PROBE_EVERY == 0


@dataclass(frozen=True)
class OffloadHits:
    """Blocks ``first``.. of a request found below the device pool, each with its tier."""

    first: int
    tiers: tuple[str, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.tiers)

    @property
    def host_only(self) -> bool:
        """Every block is in the host tier: its load needs no file, so it can be issued
        before the step's forward and the sequence run in that step."""
        return all(tier == HOST for tier in self.tiers)


@dataclass
class _Load:
    hashes: list[BlockHash]
    tiers: tuple[str, ...]
    started: float
    # blocks whose read failed: they left both tiers with their pins
    released: set[int] = field(default_factory=set)

    def held(self) -> list[tuple[BlockHash, str]]:
        """The (hash, tier) of the blocks this load still pins."""
        return [(h, tier) for index, (h, tier) in enumerate(zip(self.hashes, self.tiers,
                                                                strict=True))
                if index not in self.released]


@dataclass(frozen=True)
class LoadResult:
    num_host_blocks: int  # of the blocks that arrived, those found in the host tier
    num_disk_blocks: int  # and on disk
    seconds: float  # from the load's start to its report


@dataclass
class TierCounters:
    """Blocks moved since start-up, by direction (the engine turns them into bytes)."""

    stored_to_host: int = 0
    not_written: int = 0  # blocks cached while the write-through was off
    written_to_disk: int = 0
    loaded_from_host: int = 0
    read_from_disk: int = 0
    exported: int = 0  # read for another replica
    imported: int = 0  # pulled from another replica into the host tier
    copied_bytes: int = 0  # device <-> host, as rank 0 measured them
    copy_seconds: float = 0.0
    store_plan_seconds: float = 0.0  # the host's time planning the write-through (``take``)

    def plan_seconds_per_block(self) -> float:
        """The host's time to plan one block's store, on average since start-up."""
        return self.store_plan_seconds / self.stored_to_host if self.stored_to_host else 0.0


@dataclass
class _Pending:
    block_id: int
    token_ids: tuple[int, ...]


class TierManager:
    def __init__(self, host: HostTier, disk: DiskTier | None, block_size: int) -> None:
        self.host = host
        self.disk = disk
        self.block_size = block_size
        # cached on the device since the last step message, not in the host tier yet
        self.pending: dict[BlockHash, _Pending] = {}
        self.loads: dict[str, _Load] = {}  # request id -> its load under way
        self.plan = KVTransfers()  # the next step message's copies, gathered until taken
        self.counters = TierCounters()
        self._planned_disk: list[BlockHash] = []  # disk entries pinned until the plan is sent
        self._planned_host: list[BlockHash] = []  # imported host entries, likewise
        self.exports: dict[str, list[BlockHash]] = {}  # export id -> the blocks it pins
        self.write_through = True  # the scheduler's price (router/kv_pricing.py store_pays)

    # -- write-through and swap-out -------------------------------------------------------

    def on_cached(self, block: KVBlock, request_id: str) -> None:
        """A block ``request_id`` computed just entered the device prefix cache: write it
        through (once per hash), unless the write-through is off for this request."""
        assert block.block_hash is not None
        if self.write_through or writes_anyway(request_id) or block.block_hash in self.host:
            self._write(block)
        else:
            self.counters.not_written += 1

    def swap_out(self, blocks: Sequence[KVBlock]) -> None:
        """A preempted sequence's cached blocks: those the host tier lost are copied there
        again, the others become its most recently used, so the sequence resumes from them
        (the swap is priced on its own: router/kv_pricing.py swap_pays)."""
        for block in blocks:
            if block.block_hash is not None:
                self._write(block)

    def _write(self, block: KVBlock) -> None:
        """The block to the host tier once (the next step's message copies it), or, where it
        is there already, made its most recently used."""
        block_hash = block.block_hash
        assert block_hash is not None
        if block_hash in self.host:
            self.host.touch(block_hash)
        elif block_hash not in self.pending:
            self.pending[block_hash] = _Pending(block.block_id, block.token_ids)

    # -- lookup and load ------------------------------------------------------------------

    def find(self, hashes: Sequence[BlockHash], token_ids: Sequence[int], first: int,
             stop: int) -> OffloadHits:
        """Blocks first..stop-1 that the host tier, then disk, hold: a contiguous run."""
        tiers: list[str] = []
        size = self.block_size
        for index in range(first, min(stop, len(hashes))):
            block_hash = hashes[index]
            if self.host.lookup(block_hash, token_ids[index * size:(index + 1) * size]):
                tiers.append(HOST)
            elif self.disk is not None and self.disk.lookup(block_hash):
                tiers.append(DISK)
            else:
                break
        return OffloadHits(first, tuple(tiers))

    def start_load(self, request_id: str, hashes: Sequence[BlockHash],
                   token_ids: Sequence[Sequence[int]], tiers: Sequence[str],
                   block_ids: Sequence[int], in_step: bool = False) -> int:
        """Plans a load of the blocks ``hashes`` (found by ``find``) into the device blocks
        ``block_ids``; returns how many it loads (fewer when the host tier has no slot left
        for a disk block: the rest is recomputed)."""
        # all pinned first: a disk block's host slot evicts a host block to disk, which may
        # evict a disk block; neither may be one of these
        for block_hash, tier in zip(hashes, tiers, strict=True):
            self._tier(tier).pin(block_hash)
        slots: list[int] = []
        for index, (block_hash, tier) in enumerate(zip(hashes, tiers, strict=True)):
            if tier == HOST:
                block = self.host.index.get(block_hash)
                assert block is not None
                slots.append(block.slot)
                continue
            got = self.host.allocate(block_hash, token_ids[index], pinned=True)
            if got is None:  # every host slot is pinned: load what comes before
                for later, later_tier in zip(hashes[index:], tiers[index:], strict=True):
                    self._tier(later_tier).unpin(later)
                break
            slot, evicted = got
            self._demote(evicted)
            self.plan.from_disk.append(DiskRead(block_hash, tuple(token_ids[index]), slot))
            slots.append(slot)
        count = len(slots)
        if count:
            self.loads[request_id] = _Load(list(hashes[:count]), tuple(tiers[:count]),
                                           time.monotonic())
            self.plan.loads.append(BlockLoad(request_id, slots, list(block_ids[:count]),
                                             in_step))
        return count

    def _tier(self, tier: str) -> HostTier | DiskTier:
        if tier == HOST:
            return self.host
        assert self.disk is not None
        return self.disk

    def loading_hashes(self) -> set[BlockHash]:
        return {h for load in self.loads.values() for h in load.hashes}

    def finish_load(self, request_id: str, num_ok: int) -> LoadResult | None:
        """A load's report: its blocks are unpinned; None for a load cancelled meanwhile."""
        load = self.loads.pop(request_id, None)
        if load is None:
            return None
        self._unpin(load)
        arrived = load.tiers[:num_ok]
        self.counters.loaded_from_host += len(arrived)
        self.counters.read_from_disk += arrived.count(DISK)
        return LoadResult(arrived.count(HOST), arrived.count(DISK),
                          time.monotonic() - load.started)

    def cancel_load(self, request_id: str) -> None:
        """The sequence is gone (aborted). The workers' copies may still be under way: they
        are ordered before any later use of those slots and blocks (workers/kv_offload.py);
        copies not started yet (a load still waiting for files) are dropped."""
        load = self.loads.pop(request_id, None)
        if load is not None:
            self._unpin(load)
            # a load waiting for its disk reads is dropped by the workers before its copies
            self.plan.cancelled.append(request_id)

    def _unpin(self, load: _Load) -> None:
        for block_hash, tier in load.held():
            self.host.unpin(block_hash)
            if tier == DISK and self.disk is not None:
                self.disk.unpin(block_hash)

    def apply(self, report: TransferReport) -> dict[str, LoadResult]:
        """The workers' report: failed reads leave both tiers, finished loads are unpinned,
        and a failed disk switches that tier off. Returns the finished loads' results."""
        self.counters.copied_bytes += report.copied_bytes
        self.counters.copy_seconds += report.copy_seconds
        for block_hash in report.failed_reads:
            self.host.discard(block_hash)
            if self.disk is not None:
                self.disk.discard(block_hash)
            for load in self.loads.values():  # the pins went with the entries
                load.released.update(i for i, h in enumerate(load.hashes) if h == block_hash)
        results = {}
        for request_id, num_ok in report.loaded.items():
            result = self.finish_load(request_id, num_ok)
            if result is not None:
                results[request_id] = result
        if report.disk_error is not None and self.disk is not None:
            self.disk.disable(report.disk_error)
        return results

    # -- across replicas ------------------------------------------------------------------

    def start_export(self, export_id: str, hashes: Sequence[BlockHash],
                     token_ids: Sequence[Sequence[int]]) -> list[int]:
        """The host slots of the leading blocks of ``hashes`` that the host tier holds (a
        contiguous run, verified against their tokens), pinned until ``finish_export``: the
        shards read them for another replica meanwhile."""
        if export_id in self.exports:
            raise ValueError(f"export id '{export_id}' is already in use")
        slots: list[int] = []
        for block_hash, tokens in zip(hashes, token_ids, strict=False):
            block = self.host.lookup(block_hash, tokens)
            if block is None:
                break
            slots.append(block.slot)
        pinned = list(hashes[:len(slots)])
        for block_hash in pinned:
            self.host.pin(block_hash)
        self.exports[export_id] = pinned
        self.counters.exported += len(pinned)
        return slots

    def finish_export(self, export_id: str) -> None:
        for block_hash in self.exports.pop(export_id, []):
            self.host.unpin(block_hash)

    def import_blocks(self, import_id: str, hashes: Sequence[BlockHash],
                      token_ids: Sequence[Sequence[int]]) -> int:
        """Host slots for the blocks another replica exported (staged in every shard under
        ``import_id``, one row a block), written by the next step; blocks already here are
        touched instead. Returns how many are imported (fewer when every slot is pinned)."""
        rows: list[int] = []
        slots: list[int] = []
        for row, (block_hash, tokens) in enumerate(zip(hashes, token_ids, strict=True)):
            if block_hash in self.host:
                self.host.touch(block_hash)
                continue
            got = self.host.allocate(block_hash, tokens, pinned=True)
            if got is None:
                break
            slot, evicted = got
            self._demote(evicted)  # written to disk before the import overwrites its slot
            self._planned_host.append(block_hash)
            rows.append(row)
            slots.append(slot)
        # planned even when empty: the shards drop the staged bytes then
        self.plan.imports.append(HostImport(import_id, rows, slots))
        self.counters.imported += len(rows)
        return len(rows)

    # -- the step message -------------------------------------------------------------------

    def take(self, pool: BlockPool) -> KVTransfers | None:
        """The copies the next step carries: the loads planned since the last one, plus the
        write-through of the blocks cached since (a slot each, evicting to disk as needed).
        Blocks that find no slot (every one pinned by this step's own stores and loads: a
        host tier smaller than a step's write-through) wait for the next step while the
        device still holds them, so each passes through to the host tier and on to disk."""
        started = time.perf_counter()
        allocated: list[BlockHash] = []
        waiting: dict[BlockHash, _Pending] = {}
        for block_hash, pending in self.pending.items():
            if block_hash in self.host:
                continue
            # the block may have been handed out again in this step: it still holds its KV
            # until this step's forward, so it is copied before that (a block that waits was
            # intact when the last message went, so it was handed out in this step or not)
            intact = pool.blocks[pending.block_id].block_hash == block_hash
            got = self.host.allocate(block_hash, pending.token_ids, pinned=True)
            if got is None:
                if intact:  # the next step's message writes it; else its KV is gone
                    waiting[block_hash] = pending
                continue
            slot, evicted = got
            allocated.append(block_hash)
            self._demote(evicted)
            store = (pending.block_id, slot)
            (self.plan.stores if intact else self.plan.stores_first).append(store)
        self.counters.stored_to_host += len(allocated)
        self.pending = waiting
        # pinned while planning so that one step never evicts what it also writes
        for block_hash in allocated:
            self.host.unpin(block_hash)
        if allocated:
            self.counters.store_plan_seconds += time.perf_counter() - started
        for block_hash in self._planned_disk:
            if self.disk is not None and block_hash in self.disk:
                self.disk.unpin(block_hash)
        self._planned_disk.clear()
        for block_hash in self._planned_host:
            self.host.unpin(block_hash)
        self._planned_host.clear()
        if self.disk is not None:
            self.plan.disk_deletes.extend(self.disk.take_deletes())
        plan, self.plan = self.plan, KVTransfers()
        return None if plan.is_empty else plan

    def _demote(self, evicted: tuple[BlockHash, HostBlock] | None) -> None:
        """A block leaving the host tier goes to disk (unless it is there already)."""
        if evicted is None or self.disk is None:
            return
        block_hash, block = evicted
        if self.disk.add(block_hash):
            self.disk.pin(block_hash)
            self._planned_disk.append(block_hash)
            self.plan.to_disk.append(DiskWrite(block.slot, block_hash, block.token_ids))
            self.counters.written_to_disk += 1

    def check_integrity(self) -> None:
        """Each tier's conservation, and every pin accounted for by a load under way."""
        self.host.check_integrity()
        if self.disk is not None:
            self.disk.check_integrity()
        host_pins: dict[BlockHash, int] = {}
        disk_pins: dict[BlockHash, int] = {}
        for block_hash in self._planned_disk:  # written by the step message not sent yet
            disk_pins[block_hash] = disk_pins.get(block_hash, 0) + 1
        for block_hash in [*self._planned_host, *(h for e in self.exports.values() for h in e)]:
            host_pins[block_hash] = host_pins.get(block_hash, 0) + 1
        for load in self.loads.values():
            for block_hash, tier in load.held():
                host_pins[block_hash] = host_pins.get(block_hash, 0) + 1
                if tier == DISK:
                    disk_pins[block_hash] = disk_pins.get(block_hash, 0) + 1
        for block_hash, entry in self.host.index.entries.items():
            assert entry.pins == host_pins.get(block_hash, 0), (
                f"host block {block_hash.hex()[:16]}: {entry.pins} pins, "
                f"{host_pins.get(block_hash, 0)} loads")
        if self.disk is not None:
            for block_hash, disk_entry in self.disk.index.entries.items():
                assert disk_entry.pins == disk_pins.get(block_hash, 0), (
                    f"disk block {block_hash.hex()[:16]}: {disk_entry.pins} pins, "
                    f"{disk_pins.get(block_hash, 0)} loads")

