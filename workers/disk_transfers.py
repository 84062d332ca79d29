"""The host <-> disk side of a shard's offloader: block files written and read off the step
(``disk_io.py``), and the loads that wait for their reads.

A load that needs a block read from disk (or a slot another load's read is still filling)
waits here while the step goes on; once every read it needs is done on every shard (an
all-reduce each step while loads wait: the shards agree, as they do on a refused file), its
host -> device copies are queued like any other load's, up to its first refused block. An idle
step waits for the oldest waiting load's reads, so that the engine never spins on them.

Every shard gets the same step messages, so every shard holds the same waiting loads in the
same order and makes the same collective calls.
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.block_hash import BlockHash
from kvstore.transfers import BlockLoad, DiskRead, DiskWrite
from workers.disk_io import DiskIO, ReadJob
from workers.layers.parallel import TensorParallelGroup


@dataclass
class _Waiting:
    load: BlockLoad
    reads: list[tuple[DiskRead, ReadJob]]  # the reads this step queued for it
    needs: list[ReadJob]  # every read it waits for (its own and other loads' reads)

    def done(self) -> bool:
        return all(job.done.is_set() for job in self.needs)


@dataclass
class Released:
    """Loads whose reads are done everywhere: ``failed_slots`` end them (the engine recomputes
    from there); ``failed_reads`` are the refused blocks, each reported once."""

    loads: list[BlockLoad]
    failed_slots: set[int]
    failed_reads: list[BlockHash]


class DiskTransfers:
    def __init__(self, directory: Path | None, layout_tag: str, host: torch.Tensor,
                 tp: TensorParallelGroup, device: torch.device) -> None:
        self.io = DiskIO(directory, layout_tag, tp.rank, tp.size) if directory else None
        self.host = host
        self.tp = tp
        self.device = device
        self.failed = False  # a write failed on some shard: no more disk copies from here
        self.waiting: deque[_Waiting] = deque()
        self.reading: dict[int, ReadJob] = {}  # host slot -> the read filling it
        # slots whose file was refused, until written again: a load planned before the engine
        # heard of it takes them for host-tier blocks, and must stop there
        self.refused: set[int] = set()

    def slot_ready(self, slot: int) -> None:
        """Before anything else writes or reads a slot: a read still filling it has landed
        (a load cancelled meanwhile leaves its read behind)."""
        job = self.reading.get(slot)
        if job is not None:
            job.wait()

    def reuse(self, slot: int) -> None:
        """Before a slot is written again (a store, an import, a read)."""
        self.slot_ready(slot)
        self.refused.discard(slot)

    def write(self, writes: list[DiskWrite], host_ready: Callable[[int], None]) -> None:
        """Queues the files of blocks leaving the host tier, each a copy of its slot taken
        now: the step writes the slot again after this."""
        if self.io is None or self.failed:
            return
        for write in writes:
            host_ready(write.slot)
            self.slot_ready(write.slot)
            data = self.host[write.slot].numpy().tobytes()
            self.io.write(write.block_hash, write.token_ids, data)

    def delete(self, block_hashes: list[BlockHash]) -> None:
        """Removes the files of blocks the disk tier evicted, after their queued writes (even
        once a write failed: what it left is not in the index)."""
        if self.io is None:
            return
        for block_hash in block_hashes:
            self.io.delete(block_hash)

    def check_error(self) -> str | None:
        """Whether a write failed on any shard, once (then the tier is off here); every shard
        calls it in the same steps."""
        if self.failed:
            return None
        local = self.io.error if self.io is not None else None
        if not self.tp.any_true_each([local is not None], self.device)[0]:
            return None
        self.failed = True
        return local or "a block file write failed on another shard"

    def start(self, reads: list[DiskRead], loads: list[BlockLoad],
              host_ready: Callable[[int], None]) -> list[BlockLoad]:
        """Queues this step's reads; returns the loads that need none (their copies go now),
        the others wait."""
        jobs: dict[int, tuple[DiskRead, ReadJob]] = {}
        for read in reads:
            host_ready(read.slot)
            self.reuse(read.slot)
            jobs[read.slot] = (read, self._read(read))
            self.reading[read.slot] = jobs[read.slot][1]
        now = []
        for load in loads:
            needs = [self.reading[slot] for slot in load.host_slots if slot in self.reading]
            if not needs:
                now.append(load)
                continue
            own = [jobs[slot] for slot in load.host_slots if slot in jobs]
            self.waiting.append(_Waiting(load, own, needs))
        return now

    def _read(self, read: DiskRead) -> ReadJob:
        into = memoryview(self.host[read.slot].numpy())
        if self.io is None or self.failed:
            job = ReadJob(read.slot, reason="the disk tier is off")
            job.done.set()
            return job
        return self.io.read(read.block_hash, read.token_ids, read.slot, into)

    def cancel(self, request_ids: list[str]) -> None:
        """Loads the engine dropped (their sequences are gone, their device blocks handed out
        again): never copied. Their reads still land, and report their refused files."""
        if not request_ids:
            return
        gone = set(request_ids)
        for waiting in self.waiting:
            if waiting.load.request_id in gone:
                waiting.load = BlockLoad(waiting.load.request_id, [], [])

    def release(self, idle: bool) -> Released:
        """The leading waiting loads whose reads are done on every shard. ``idle``: the step
        ran nothing, so this shard waits for the oldest one's reads first."""
        released = Released([], set(self.refused), [])
        if not self.waiting:
            return released
        if idle:
            for job in self.waiting[0].needs:
                job.wait()
        pending = self.tp.any_true_each([not w.done() for w in self.waiting], self.device)
        count = next((i for i, busy in enumerate(pending) if busy), len(pending))
        batch = [self.waiting.popleft() for _ in range(count)]
        if not batch:
            return released
        flags = [job.reason is not None for w in batch for job in w.needs]
        refused = iter(self.tp.any_true_each(flags, self.device))
        for waiting in batch:
            bad = {job.slot for job in waiting.needs if next(refused)}
            released.failed_slots |= bad
            self.refused |= {read.slot for read, job in waiting.reads if job.slot in bad}
            released.failed_reads += [read.block_hash for read, job in waiting.reads
                                      if job.slot in bad]
            for _, job in waiting.reads:
                if self.reading.get(job.slot) is job:
                    del self.reading[job.slot]
            if waiting.load.block_ids:
                released.loads.append(waiting.load)
        return released

    def flush(self) -> None:
        if self.io is not None:
            self.io.flush()
