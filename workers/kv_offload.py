"""A shard's copies of KV blocks between its device cache, its host buffer and block files:
what each step's ``KVTransfers`` asks (kvstore/transfers.py), in that order.

The host buffer holds ``num_slots`` slots; a slot is one block of every tensor of every layer,
back to back (``BlockLayout``), so a block is one contiguous run of bytes: one memcpy to or
from the device per run of consecutive slots, and one write or read of its file.

On a GPU the slots are pinned memory and every copy runs on a CUDA stream of its own, batched
through a device staging buffer (one gather or scatter per cache tensor for the whole batch).
The step never waits for a copy, with two exceptions, each a wait of the compute stream on the
copy's event (the GPU waits, not the host), and only when a copy is still in flight:

- a block this step writes whose copy to the host has not finished (the pool handed it out
  again), or
- a block this step reads or writes that a load is still filling (on another shard of the
  same step the load may lag behind the driver's, which reported it done).

The host itself waits for a copy only to read or write a slot by CPU (a file to or from it,
or another replica's blocks: ``export`` and ``stage_import`` run on the actor's own thread beside
the steps, and touch only pinned slots and the staging dict).
On the CPU the same code runs with plain tensors: every copy is done when it returns, and
nothing is ever in flight.
"""

import contextlib
import hashlib
import json
import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvstore.block_file import block_file_name, read_block_file, write_block_file
from kvstore.transfers import BlockLoad, HostImport, KVTransfers, TransferReport
from workers.kv_cache import KVCaches
from workers.layers.parallel import TensorParallelGroup

log = logging.getLogger(__name__)

STAGE_BLOCKS = 32  # blocks per batch through the device staging buffer


def layer_tensors(kv_caches: KVCaches) -> list[torch.Tensor]:
    """Every tensor of every layer's cache, each indexed by block id along dim 0: K and V
    today, and whatever else a layer's cache holds per block (a quantized cache's scales)."""
    return [tensor for layer in kv_caches
            for tensor in (layer.k, layer.v, layer.k_scale, layer.v_scale) if tensor is not None]


@dataclass(frozen=True)
class BlockLayout:
    """Where each cache tensor's share of one block sits in a slot's bytes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]  # bytes of one block of each tensor
    block_bytes: int
    tag: str  # names dtypes and shapes (and the tensor-parallel size): files of another differ

    @classmethod
    def of(cls, tensors: list[torch.Tensor], tp_size: int) -> "BlockLayout":
        offsets, sizes, offset = [], [], 0
        for tensor in tensors:
            if offset % tensor.element_size():
                raise ValueError(f"a {tensor.dtype} cache tensor would start at byte {offset} "
                                 "of a host slot, not a multiple of its element size")
            size = tensor[0].numel() * tensor.element_size()
            offsets.append(offset)
            sizes.append(size)
            offset += size
        described = json.dumps([tp_size] + [[str(t.dtype), list(t.shape[1:])] for t in tensors])
        tag = hashlib.sha256(described.encode()).hexdigest()[:16]
        return cls(tuple(offsets), tuple(sizes), offset, tag)

    def views(self, buffer: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor's blocks inside a (slots, block_bytes) byte buffer, shaped as it is."""
        rows = buffer.shape[0]
        return [buffer[:, offset:offset + size].view(t.dtype).view(rows, *t.shape[1:])
                for offset, size, t in zip(self.offsets, self.sizes, tensors, strict=True)]


@dataclass(frozen=True)
class OffloadInfo:
    """What the engine needs of a shard's host buffer to keep its index."""

    num_slots: int
    block_bytes: int  # one slot, this shard's share of a block
    layout_tag: str  # the disk tier's subdirectory: blocks of this layout only
    # measured at start-up: what pricing copies against recomputes needs (router/kv_pricing.py)
    copy_bytes_per_s: float = 0.0  # device -> host, one staging batch
    prefill_tokens_per_s: float = 0.0


@dataclass
class _Batch:
    """Copies queued on the offload stream up to ``event``."""

    event: torch.cuda.Event
    start: "torch.cuda.Event | None" = None  # when the stream began these copies (timing)
    num_bytes: int = 0
    loads_into: set[int] = field(default_factory=set)  # device blocks being written
    stores_from: set[int] = field(default_factory=set)  # device blocks being read
    slots: set[int] = field(default_factory=set)  # host slots read or written


@dataclass
class _PendingLoad:
    request_id: str
    num_ok: int
    event: "torch.cuda.Event | None"


class KVOffloader:
    def __init__(self, tensors: list[torch.Tensor], num_slots: int, disk_dir: str | None,
                 tp: TensorParallelGroup) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV buffer needs at least 1 slot, got {num_slots}")
        self.tensors = tensors
        self.device = tensors[0].device
        self.on_gpu = self.device.type == "cuda"
        self.tp = tp
        self.layout = BlockLayout.of(tensors, tp.size)
        self.num_slots = num_slots
        self.host = torch.empty((num_slots, self.layout.block_bytes), dtype=torch.uint8,
                                pin_memory=self.on_gpu)
        self.host_views = self.layout.views(self.host, tensors)
        self.stream = torch.cuda.Stream(self.device) if self.on_gpu else None
        # batches of blocks pass through here, contiguous, on their way to or from the slots
        self.stage = torch.empty((STAGE_BLOCKS, self.layout.block_bytes), dtype=torch.uint8,
                                 device=self.device)
        self.stage_views = self.layout.views(self.stage, tensors)
        self.directory = Path(disk_dir) / self.layout.tag if disk_dir else None
        self.disk_failed = False  # a write failed: no more disk copies from this shard
        self.batches: deque[_Batch] = deque()  # in flight, oldest first (one stream: FIFO)
        self.pending_loads: list[_PendingLoad] = []
        self._report = TransferReport()
        self._step_start: torch.cuda.Event | None = None
        self.staged: dict[str, torch.Tensor] = {}  # import id -> (blocks, block_bytes) bytes
        self._copy_start: torch.cuda.Event | None = None  # the batch being queued (_timed)
        self._copy_bytes = 0

    @property
    def info(self) -> OffloadInfo:
        return OffloadInfo(self.num_slots, self.layout.block_bytes, self.layout.tag)

    def measure_copy_bandwidth(self, repeats: int = 3) -> float:
        """Device -> host bytes a second over one staging batch into pinned slots (the
        write-through's path), the best of ``repeats``; at start-up, before any block is
        offloaded."""
        count = min(STAGE_BLOCKS, self.num_slots)
        best = float("inf")
        for _ in range(repeats):
            self._synchronize()
            started = time.perf_counter()
            self.host[:count].copy_(self.stage[:count], non_blocking=True)
            self._synchronize()
            best = min(best, time.perf_counter() - started)
        return count * self.layout.block_bytes / max(best, 1e-9)

    def _synchronize(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize(self.device)

    # -- a step ---------------------------------------------------------------------------

    def before_step(self, transfers: KVTransfers | None, touched: Iterable[int],
                    written: Iterable[int]) -> None:
        """The copies that come before the forward, then the compute stream's waits for the
        blocks this step ``touched`` (reads or writes) and ``written``."""
        self._retire()
        if self.on_gpu:  # what the compute stream has queued so far: earlier steps' writes
            self._step_start = torch.cuda.Event()
            self._step_start.record()
        if transfers is not None:
            self._write_files(transfers)
            self._store(transfers.stores_first)
            for host_import in transfers.imports:
                self._import(host_import)
            failed_slots = self._read_files(transfers)
            if transfers.loads:
                self._load_all(transfers.loads, failed_slots)
        if self.batches:
            self._wait_for(touched, written)

    def after_step(self, transfers: KVTransfers | None) -> None:
        """Write-through of the blocks cached last step, behind this step's forward."""
        if transfers is not None and transfers.stores:
            self._store(transfers.stores)

    def report(self, idle: bool) -> TransferReport:
        """The loads whose copies have landed (and the failures) since the last report. An
        ``idle`` step (no sequence ran) waits for the oldest load rather than report none."""
        if idle and self.pending_loads and self.pending_loads[0].event is not None:
            self.pending_loads[0].event.synchronize()
        still = []
        for load in self.pending_loads:
            if load.event is None or load.event.query():
                self._report.loaded[load.request_id] = load.num_ok
            else:
                still.append(load)
        self.pending_loads = still
        report, self._report = self._report, TransferReport()
        return report

    # -- device <-> host ------------------------------------------------------------------

    def _store(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host slot) copies, device to host, in batches through the staging
        buffer: one gather per cache tensor, then one copy per run of consecutive slots."""
        pairs = sorted(pairs, key=lambda pair: pair[1])
        for start in range(0, len(pairs), STAGE_BLOCKS):
            chunk = pairs[start:start + STAGE_BLOCKS]
            blocks, slots = [b for b, _ in chunk], [s for _, s in chunk]
            n = len(chunk)
            with self._on_copy_stream(), self._timed(n):
                block_index = self._to_device(blocks)
                torch.cat([t.index_select(0, block_index).view(n, -1).view(torch.uint8)
                           for t in self.tensors], dim=1, out=self.stage[:n])
                for slot, row, count in _runs(slots):
                    self.host[slot:slot + count].copy_(self.stage[row:row + count],
                                                       non_blocking=True)
                self._record(stores_from=set(blocks), slots=set(slots))

    def _load_all(self, loads: list[BlockLoad], failed_slots: set[int]) -> None:
        """Every load; one whose copies raised on any shard is reported with no block
        intact (the engine recomputes its tokens), the others as they land."""
        started: list[_PendingLoad] = []
        failed: list[bool] = []
        for load in loads:
            try:
                started.append(self._load(load, failed_slots))
                failed.append(False)
            except RuntimeError as error:
                log.warning("loading %d KV blocks for %s failed (%s): its tokens are "
                            "recomputed", len(load.block_ids), load.request_id, error)
                started.append(_PendingLoad(load.request_id, 0, None))
                failed.append(True)
        agreed = self.tp.any_true_each(failed, self.device)  # every shard, or none, loads
        for pending, bad in zip(started, agreed, strict=True):
            self.pending_loads.append(_PendingLoad(pending.request_id, 0, None) if bad
                                      else pending)

    def _load(self, load: BlockLoad, failed_slots: set[int]) -> _PendingLoad:
        """Host slots to device blocks, up to the first slot whose file was refused: one copy
        per run of consecutive slots into the staging buffer, one scatter per cache tensor."""
        num_ok = next((i for i, slot in enumerate(load.host_slots) if slot in failed_slots),
                      len(load.host_slots))
        pairs = sorted(zip(load.host_slots[:num_ok], load.block_ids[:num_ok], strict=True))
        event = None
        for start in range(0, len(pairs), STAGE_BLOCKS):
            chunk = pairs[start:start + STAGE_BLOCKS]
            slots, blocks = [s for s, _ in chunk], [b for _, b in chunk]
            n = len(chunk)
            with self._on_copy_stream(), self._timed(n):
                for slot, row, count in _runs(slots):
                    self.stage[row:row + count].copy_(self.host[slot:slot + count],
                                                      non_blocking=True)
                block_index = self._to_device(blocks)
                for view, tensor in zip(self.stage_views, self.tensors, strict=True):
                    tensor.index_copy_(0, block_index, view[:n])
                event = self._record(loads_into=set(blocks), slots=set(slots))
        return _PendingLoad(load.request_id, num_ok, event)

    def _on_copy_stream(self) -> contextlib.AbstractContextManager[object]:
        """The copy stream, behind what the compute stream queued before this step (on the
        CPU: nothing, every copy is done when it returns)."""
        if self.stream is None:
            return contextlib.nullcontext()
        assert self._step_start is not None
        self.stream.wait_event(self._step_start)
        return torch.cuda.stream(self.stream)

    def _to_device(self, ids: list[int]) -> torch.Tensor:
        """Block ids on the device without a host wait (a pinned, asynchronous copy)."""
        index = torch.tensor(ids, dtype=torch.int64)
        if not self.on_gpu:
            return index
        return index.pin_memory().to(self.device, non_blocking=True)

    def _record(self, loads_into: set[int] | None = None, stores_from: set[int] | None = None,
                slots: set[int] | None = None) -> "torch.cuda.Event | None":
        """Marks the copies queued so far (on a GPU; None on the CPU, where they are done)."""
        if self.stream is None:
            return None
        batch = _Batch(torch.cuda.Event(enable_timing=True), self._copy_start,
                       self._copy_bytes, loads_into or set(), stores_from or set(),
                       slots or set())
        batch.event.record(self.stream)
        self.batches.append(batch)
        return batch.event

    def _retire(self) -> None:
        while self.batches and self.batches[0].event.query():
            self._count_copy(self.batches.popleft())

    def _count_copy(self, batch: _Batch) -> None:
        """A finished batch's bytes and time on the copy stream (its copies alone: the start
        event fires once the stream gets to them), for the measured transfer rate."""
        if batch.start is not None:
            self._report.copied_bytes += batch.num_bytes
            self._report.copy_seconds += batch.start.elapsed_time(batch.event) / 1e3

    @contextlib.contextmanager
    def _timed(self, num_blocks: int) -> "Iterator[None]":
        """Around one batch of device <-> host copies: their bytes and time (the CPU's are
        done on return; a GPU's are timed by events on the copy stream, see ``_count_copy``)."""
        self._copy_bytes = num_blocks * self.layout.block_bytes
        if self.stream is not None:
            self._copy_start = torch.cuda.Event(enable_timing=True)
            self._copy_start.record(self.stream)
            yield
            return
        started = time.perf_counter()
        yield
        self._report.copied_bytes += self._copy_bytes
        self._report.copy_seconds += time.perf_counter() - started

    def _wait_for(self, touched: Iterable[int], written: Iterable[int]) -> None:
        """The compute stream waits for the last in-flight copy it must not overtake (one
        stream: waiting for it covers every copy before it)."""
        touched, written = set(touched), set(written)
        for batch in reversed(self.batches):
            if batch.loads_into & (touched | written) or batch.stores_from & written:
                torch.cuda.current_stream().wait_event(batch.event)
                return

    def _host_ready(self, slot: int) -> None:
        """Before the CPU reads or writes a slot: the copies in flight on it have landed."""
        for batch in reversed(self.batches):
            if slot in batch.slots:
                batch.event.synchronize()
                return

    # -- host <-> another replica ------------------------------------------------------------

    def export(self, slots: list[int]) -> torch.Tensor:
        """A copy of the (pinned) slots, one row each, for another replica. Called beside the
        steps: it waits for every copy queued on the offload stream (a write-through into one
        of them may be in flight), not for the steps."""
        if self.stream is not None:
            self.stream.synchronize()
        return self.host[torch.tensor(slots, dtype=torch.int64)] if slots else \
            self.host[:0].clone()

    def stage_import(self, import_id: str, rows: torch.Tensor) -> None:
        """Another replica's exported blocks, kept until a step's ``HostImport`` writes them."""
        if rows.dtype != torch.uint8 or rows.dim() != 2 or (
                rows.shape[1] != self.layout.block_bytes):
            raise ValueError(f"staged KV blocks must be uint8 rows of {self.layout.block_bytes} "
                             f"bytes, got {rows.dtype} {tuple(rows.shape)}")
        self.staged[import_id] = rows

    def _import(self, host_import: HostImport) -> None:
        rows = self.staged.pop(host_import.import_id, None)
        if rows is None:  # staging failed on this shard: the engine planned no rows then
            assert not host_import.rows, f"import {host_import.import_id} was never staged"
            return
        for row, slot in zip(host_import.rows, host_import.slots, strict=True):
            self._host_ready(slot)
            self.host[slot].copy_(rows[row])

    # -- host <-> disk ----------------------------------------------------------------------

    def _write_files(self, transfers: KVTransfers) -> None:
        error = None
        if self.directory is not None and transfers.to_disk and not self.disk_failed:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                for write in transfers.to_disk:
                    self._host_ready(write.slot)
                    path = self.directory / block_file_name(write.block_hash, self.tp.rank,
                                                            self.tp.size)
                    write_block_file(path, write.block_hash, self.layout.tag, write.token_ids,
                                     memoryview(self.host[write.slot].numpy()))
            except OSError as failure:
                error = f"writing a block file failed ({failure.strerror or failure})"
        if transfers.to_disk:  # every shard learns whether any failed
            failed = self.tp.any_true_each([error is not None], self.device)[0]
            if failed and not self.disk_failed:
                self.disk_failed = True
                self._report.disk_error = error or "a block file write failed on another shard"

    def _read_files(self, transfers: KVTransfers) -> set[int]:
        """Reads the files into their slots; the slots of those refused on any shard."""
        if not transfers.from_disk:
            return set()
        refused = []
        for read in transfers.from_disk:
            reason = "the disk tier is off" if self.directory is None or self.disk_failed \
                else None
            if reason is None:
                assert self.directory is not None
                self._host_ready(read.slot)
                path = self.directory / block_file_name(read.block_hash, self.tp.rank,
                                                        self.tp.size)
                reason = read_block_file(path, read.block_hash, self.layout.tag, read.token_ids,
                                         memoryview(self.host[read.slot].numpy()))
                if reason is not None:
                    log.warning("KV block file %s refused (%s): its tokens are recomputed",
                                path, reason)
            refused.append(reason is not None)
        refused = self.tp.any_true_each(refused, self.device)
        failed = [read for read, bad in zip(transfers.from_disk, refused, strict=True) if bad]
        self._report.failed_reads.extend(read.block_hash for read in failed)
        return {read.slot for read in failed}


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first slot, first row, count) of each run of consecutive slots in a sorted list."""
    runs: list[tuple[int, int, int]] = []
    for row, slot in enumerate(slots):
        if runs and runs[-1][0] + runs[-1][2] == slot:
            first, first_row, count = runs[-1]
            runs[-1] = (first, first_row, count + 1)
        else:
            runs.append((slot, row, 1))
    return runs
