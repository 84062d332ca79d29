"""A shard's copies of KV blocks between its device cache, its host buffer and block files:
what each step's ``KVTransfers`` asks (kvstore/transfers.py), in that order.

The host buffer holds ``num_slots`` slots; a slot is one block of every tensor of every layer,
back to back (``BlockLayout``), so a block is one contiguous run of bytes: one memcpy to or
from the device per run of consecutive slots, and one write or read of its file.

On a GPU the slots are pinned memory and the copies run on two CUDA streams of their own,
batched through a device staging buffer (one gather or scatter per kind of cache tensor over
every layer for the whole batch: workers/block_copies.py): loads (host -> device) on a
high-priority stream, so that a sequence waiting for its blocks never queues behind
write-through traffic, and stores (device -> host) on the other.
Where a load and a store share a slot or a block, the later one's stream waits for the earlier
one's copy (``_order_after``).
The step never waits for a copy, with two exceptions, each a wait of the compute stream on the
copy's event (the GPU waits, not the host), and only when a copy is still in flight:

- a block this step writes whose copy to the host has not finished (the pool handed it out
  again), or
- a block this step reads or writes that a load is still filling (on another shard of the
  same step the load may lag behind the driver's, which reported it done).

A copy starts once the compute stream has finished what it had queued before the step that
asks for it (``_step_start``: a block the pool hands out again may still be read or written by
the step before), except a load none of whose blocks the step in flight uses (``busy``: every
block of the sequences it ran, preempted ones included): with async scheduling the step before
is still running when the next one's loads are issued, and such a load fills its blocks beside
it instead of after it.

Block files are written and read on a background thread (``disk_transfers.py``): a load that
needs a file waits there, off the step, and its copies are queued once the file is read.
The host itself waits for a copy only to read or write a slot by CPU (a copy of it for a file,
or another replica's blocks: ``export`` and ``stage_import`` run on the actor's own thread beside
the steps, and touch only pinned slots and the staging dict).
Where the device reads pinned slots in place (workers/pinned_copies.py, checked at start-up)
and it is asked to (``in_place``), the loads whose sequences run in the step
(``BlockLoad.in_step``) skip the staging buffer and go together, layer by layer, each chunk of
layers' event waited for by the forward just before those layers (``gate``), so most of the
copy hides under the layers before it.
On the CPU the same code runs with plain tensors: every copy is done when it returns, and
nothing is ever in flight.
"""

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvstore.transfers import BlockLoad, HostImport, KVTransfers, TransferReport
from workers.block_copies import BlockCopies
from workers.disk_transfers import DiskTransfers
from workers.host_layout import BlockLayout, OffloadInfo
from workers.layer_gate import LayerGate
from workers.layers.parallel import TensorParallelGroup
from workers.pinned_copies import PinnedCopies
from workers.step_input import StepInput

if TYPE_CHECKING:
    from workers.request_state import RequestState

log = logging.getLogger(__name__)

# a batch through a device staging buffer (two buffers of it): each batch costs the host the
# same whatever its size (a gather or scatter per kind of cache tensor, a copy per run of slots,
# two events, an index tensor), and at the 0.5B shape's 192 KiB blocks batches of 64 cost an
# H100's host 0.9-1.0 ms a step with loads (~300 blocks) and 0.7-0.9 ms one with stores only
# (~240; W4-large, tools/profile/tier_steps.py); so a batch is as many blocks as STAGE_BYTES
# holds, never fewer than STAGE_BLOCKS
STAGE_BLOCKS = 64
STAGE_BYTES = 64 << 20
LOAD, STORE = "load", "store"  # the two copy streams
LOAD_PRIORITY = -1  # CUDA: lower is sooner; the stores' stream keeps the default, 0


@dataclass
class _Batch:
    """Copies queued on one copy stream (``kind``) up to ``event``."""

    kind: str
    event: torch.cuda.Event
    start: "torch.cuda.Event | None" = None  # when the stream began these copies (timing)
    num_bytes: int = 0
    loads_into: set[int] = field(default_factory=set)  # device blocks being written
    stores_from: set[int] = field(default_factory=set)  # device blocks being read
    slots: set[int] = field(default_factory=set)  # host slots read or written
    layered: bool = False  # a chunk of layers of in-step loads: the forward waits (``gate``)


@dataclass
class _PendingLoad:
    request_id: str
    num_ok: int
    event: "torch.cuda.Event | None"


class KVOffloader:
    def __init__(self, tensors: list[torch.Tensor], num_slots: int, disk_dir: str | None,
                 tp: TensorParallelGroup, stage_blocks: int | None = None,
                 model_layers: tuple[int, int] = (0, 0), in_place: bool | None = None) -> None:
        """``model_layers``: (layers, tensors) of the model whose forward waits layer by layer
        (its tensors first in ``tensors``); (0, 0): none does. ``in_place``: whether in-step
        loads read the pinned slots in place, layer by layer; None: on a GPU that can (a
        probe)."""
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
        self.streams = {LOAD: torch.cuda.Stream(self.device, priority=LOAD_PRIORITY),
                        STORE: torch.cuda.Stream(self.device)} if self.on_gpu else {}
        # batches of blocks pass through these, contiguous, on their way to or from the slots
        # (one each: a load and a store may be in flight at once)
        self.stage_blocks = stage_blocks or stage_blocks_for(self.layout.block_bytes, num_slots)
        self.stages = {kind: torch.empty((self.stage_blocks, self.layout.block_bytes),
                                         dtype=torch.uint8, device=self.device)
                       for kind in (LOAD, STORE)}
        self.copies = BlockCopies(tensors, self.layout)  # one kernel a kind of all layers
        self.gate = LayerGate()  # the model's forward waits here for in-step loads' layers
        self.pinned: PinnedCopies | None = None
        num_layers, model_tensors = model_layers
        if num_layers and in_place is not False:
            self.pinned = PinnedCopies(self.host, self.copies, num_layers, model_tensors)
            if in_place is None and not self._in_place_copies_work():
                self.pinned = None
        directory = Path(disk_dir) / self.layout.tag if disk_dir else None
        self.disk = DiskTransfers(directory, self.layout.tag, self.host, tp, self.device)
        self._disk_step = False  # this step carried disk copies: agree on a failed write
        self.batches: deque[_Batch] = deque()  # in flight, oldest first (FIFO per stream)
        self.pending_loads: list[_PendingLoad] = []
        self._report = TransferReport()
        self._step_start: torch.cuda.Event | None = None
        self.staged: dict[str, torch.Tensor] = {}  # import id -> (blocks, block_bytes) bytes
        self._copy_start: torch.cuda.Event | None = None  # the batch being queued (_timed)
        self._copy_bytes = 0

    @property
    def directory(self) -> Path | None:
        return self.disk.io.directory if self.disk.io is not None else None

    @property
    def disk_failed(self) -> bool:
        return self.disk.failed

    def flush(self) -> None:
        """Waits for the block files queued so far (tests, shutdown)."""
        self.disk.flush()

    @property
    def info(self) -> OffloadInfo:
        return OffloadInfo(self.num_slots, self.layout.block_bytes, self.layout.tag)

    def measure_copy_bandwidth(self, repeats: int = 3) -> float:
        """Device -> host bytes a second over one staging batch into pinned slots (the
        write-through's path), the best of ``repeats``; at start-up, before any block is
        offloaded."""
        count = min(self.stage_blocks, self.num_slots)
        best = float("inf")
        for _ in range(repeats):
            self._synchronize()
            started = time.perf_counter()
            self.host[:count].copy_(self.stages[STORE][:count], non_blocking=True)
            self._synchronize()
            best = min(best, time.perf_counter() - started)
        return count * self.layout.block_bytes / max(best, 1e-9)

    def _in_place_copies_work(self) -> bool:
        """Whether the kernel reads the pinned slots here (a unified address), agreed by
        every shard: slot 0 into block 0 and back through the staged path, compared; both
        zeroed again after (nothing is cached yet)."""
        assert self.pinned is not None
        if not self.on_gpu:  # every copy is done when it returns: nothing to overlap
            return False
        index = torch.zeros(1, dtype=torch.int64, device=self.device)
        pattern = torch.randint(0, 256, (self.layout.block_bytes,), dtype=torch.uint8)
        ok = False
        try:
            self.host[0].copy_(pattern)
            for first, last in self.pinned.chunks():
                self.pinned.load(index, index, first, last)
            self.copies.gather(index, self.stages[STORE][:1])
            ok = torch.equal(self.stages[STORE][0].cpu(), pattern)
        except Exception as error:  # noqa: BLE001 - any failure means: the staged loads
            log.warning("host-tier loads go through a staging buffer: the device does not "
                        "read pinned host memory in place (%r)", error)
        self.host[0].zero_()
        self.stages[LOAD][:1].zero_()
        self.copies.scatter(index, self.stages[LOAD][:1])
        self._synchronize()
        return not self.tp.any_true_each([not ok], self.device)[0]

    def _synchronize(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize(self.device)

    # -- a step ---------------------------------------------------------------------------

    def before_step(self, transfers: KVTransfers | None, touched: Iterable[int],
                    written: Iterable[int],
                    busy: Callable[[], set[int]] | None = None) -> None:
        """The copies that come before the forward, then the compute stream's waits for the
        blocks this step ``touched`` (reads or writes) and ``written``. ``busy``: the blocks
        the step in flight may still use (asked only when a load is issued on a GPU); without
        it every load waits for that step."""
        self._retire()
        if self.on_gpu:  # what the compute stream has queued so far: earlier steps' writes
            self._step_start = torch.cuda.Event()
            self._step_start.record()
        self._disk_step = False
        if transfers is not None:
            self.disk.cancel(transfers.cancelled)
            self.disk.write(transfers.to_disk, self._host_ready)
            self.disk.delete(transfers.disk_deletes)
            self._store(transfers.stores_first)
            for host_import in transfers.imports:
                self._import(host_import)
            now = self.disk.start(transfers.from_disk, transfers.loads, self._host_ready)
            if now:
                in_flight = busy() if busy is not None and self.streams else None
                self._load_all(now, set(self.disk.refused), in_flight)
            self._disk_step = bool(transfers.to_disk or transfers.from_disk)
        if self.batches:
            self._wait_for(touched, written)
        # the first chunk holds every tensor that isn't the model's (a draft's, a head's),
        # which no layer's wait covers
        self.gate.before_layer(0)

    def after_step(self, transfers: KVTransfers | None) -> None:
        """Write-through of the blocks cached last step, behind this step's forward."""
        self.gate.wait_all()  # whatever the forward waited for: nothing runs ahead of a load
        if transfers is not None and transfers.stores:
            self._store(transfers.stores)

    def report(self, idle: bool) -> TransferReport:
        """The loads whose copies have landed (and the failures) since the last report. An
        ``idle`` step (no sequence ran) waits for the oldest load rather than report none.
        Every shard calls it after every step."""
        if self._disk_step:
            error = self.disk.check_error()
            if error is not None:
                self._report.disk_error = error
        released = self.disk.release(idle and not self.pending_loads)
        self._report.failed_reads.extend(released.failed_reads)
        if released.loads:
            self._load_all(released.loads, released.failed_slots)
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
        buffer: one gather per kind of cache tensor, then one copy per run of consecutive slots."""
        pairs = sorted(pairs, key=lambda pair: pair[1])
        stage = self.stages[STORE]
        for start in range(0, len(pairs), self.stage_blocks):
            chunk = pairs[start:start + self.stage_blocks]
            blocks, slots = [b for b, _ in chunk], [s for _, s in chunk]
            for slot in slots:
                self.disk.reuse(slot)
            n = len(chunk)
            with self._on_copy_stream(STORE, set(blocks), set(slots)), \
                    self._timed(n * self.layout.block_bytes):
                self.copies.gather(self._to_device(blocks), stage[:n])
                for slot, row, count in _runs(slots):
                    self.host[slot:slot + count].copy_(stage[row:row + count],
                                                       non_blocking=True)
                self._record(STORE, stores_from=set(blocks), slots=set(slots))

    def _load_all(self, loads: list[BlockLoad], failed_slots: set[int],
                  in_flight: set[int] | None = None) -> None:
        """Every load; one whose copies raised on any shard is reported with no block
        intact (the engine recomputes its tokens), the others as they land. ``in_flight``:
        the blocks the step in flight uses (a load of none of them need not wait for it);
        None: every load waits."""
        if self.pinned is not None and any(load.in_step for load in loads):
            self._load_layered([load for load in loads if load.in_step], in_flight)
            loads = [load for load in loads if not load.in_step]
        started: list[_PendingLoad] = []
        failed: list[bool] = []
        for load in loads:
            try:
                started.append(self._load(load, failed_slots, in_flight))
                failed.append(False)
            except RuntimeError as error:
                if load.in_step:  # its sequence's forward is this step's: it cannot go on
                    raise RuntimeError(f"loading {len(load.block_ids)} KV blocks from the host "
                                       f"tier for {load.request_id}, which runs in this step, "
                                       f"failed: {error}") from error
                log.warning("loading %d KV blocks for %s failed (%s): its tokens are "
                            "recomputed", len(load.block_ids), load.request_id, error)
                started.append(_PendingLoad(load.request_id, 0, None))
                failed.append(True)
        agreed = self.tp.any_true_each(failed, self.device)  # every shard, or none, loads
        for pending, bad in zip(started, agreed, strict=True):
            self.pending_loads.append(_PendingLoad(pending.request_id, 0, None) if bad
                                      else pending)

    def _load(self, load: BlockLoad, failed_slots: set[int],
              in_flight: set[int] | None = None) -> _PendingLoad:
        """Host slots to device blocks, up to the first slot whose file was refused: one copy
        per run of consecutive slots into the staging buffer, one scatter per kind of cache
        tensor."""
        num_ok = next((i for i, slot in enumerate(load.host_slots) if slot in failed_slots),
                      len(load.host_slots))
        pairs = sorted(zip(load.host_slots[:num_ok], load.block_ids[:num_ok], strict=True))
        event = None
        for start in range(0, len(pairs), self.stage_blocks):
            chunk = pairs[start:start + self.stage_blocks]
            slots, blocks = [s for s, _ in chunk], [b for _, b in chunk]
            n = len(chunk)
            stage = self.stages[LOAD]
            after_step = in_flight is None or not in_flight.isdisjoint(blocks)
            with self._on_copy_stream(LOAD, set(blocks), set(slots), after_step), \
                    self._timed(n * self.layout.block_bytes):
                for slot, row, count in _runs(slots):
                    stage[row:row + count].copy_(self.host[slot:slot + count],
                                                 non_blocking=True)
                self.copies.scatter(self._to_device(blocks), stage[:n])
                event = self._record(LOAD, loads_into=set(blocks), slots=set(slots))
        return _PendingLoad(load.request_id, num_ok, event)

    def _load_layered(self, loads: list[BlockLoad], in_flight: set[int] | None) -> None:
        """The in-step loads together, a chunk of the model's layers at a time, each chunk
        marked by an event the forward waits for before its layers (``gate``). A copy that
        raises fails the step: its sequences' forwards are this step's."""
        assert self.pinned is not None
        for load in loads:
            if not load.block_ids:  # nothing to copy: landed now
                self.pending_loads.append(_PendingLoad(load.request_id, 0, None))
        loads = [load for load in loads if load.block_ids]
        if not loads:
            return
        slots = [slot for load in loads for slot in load.host_slots]
        blocks = [block for load in loads for block in load.block_ids]
        block_set, slot_set = set(blocks), set(slots)
        after_step = in_flight is None or not in_flight.isdisjoint(block_set)
        chunks: list[tuple[int, object]] = []
        num_layers = self.pinned.num_layers
        try:
            with self._on_copy_stream(LOAD, block_set, slot_set, after_step):
                # made on the copy stream, which uses them: made on the compute stream, their
                # memory went back to it on return and a later step's tensor took it while
                # the copies still read it (W4-large on an H100: a fault, at random)
                slot_index, block_index = self._to_device(slots), self._to_device(blocks)
                for first, last in self.pinned.chunks():
                    size = len(blocks) * self.layout.block_bytes * (last - first) // num_layers
                    with self._timed(size):
                        self.pinned.load(slot_index, block_index, first, last)
                        event = self._record(LOAD, loads_into=block_set, slots=slot_set,
                                             layered=True)
                    chunks.append((first, event))
        except RuntimeError as error:
            raise RuntimeError(f"loading {len(blocks)} KV blocks from the host tier for "
                               f"{', '.join(load.request_id for load in loads)}, which run in "
                               f"this step, failed: {error}") from error
        self.gate.arm(chunks)
        last_event = chunks[-1][1] if self.streams else None
        for load in loads:
            self.pending_loads.append(_PendingLoad(load.request_id, len(load.block_ids),
                                                   last_event))  # type: ignore[arg-type]

    def _on_copy_stream(self, kind: str, blocks: set[int], slots: set[int],
                        after_step: bool = True) -> contextlib.AbstractContextManager[object]:
        """The ``kind`` copy stream, behind what the compute stream queued before this step
        (unless not ``after_step``: blocks no queued step uses) and behind the other
        stream's copies of these ``blocks`` and ``slots`` (on the CPU: nothing, every copy is
        done when it returns)."""
        if not self.streams:
            return contextlib.nullcontext()
        assert self._step_start is not None
        stream = self.streams[kind]
        if after_step:
            stream.wait_event(self._step_start)
        self._order_after(LOAD if kind == STORE else STORE, stream, blocks, slots)
        return torch.cuda.stream(stream)

    def _order_after(self, other: str, stream: torch.cuda.Stream, blocks: set[int],
                     slots: set[int]) -> None:
        """``stream`` waits for the last copy on the ``other`` stream that reads or writes
        one of these blocks or slots (its stream is FIFO: that covers the ones before)."""
        for batch in reversed(self.batches):
            if batch.kind == other and not (batch.slots.isdisjoint(slots)
                                            and batch.loads_into.isdisjoint(blocks)
                                            and batch.stores_from.isdisjoint(blocks)):
                stream.wait_event(batch.event)
                return

    def _to_device(self, ids: list[int]) -> torch.Tensor:
        """Block ids on the device without a host wait (a pinned, asynchronous copy)."""
        index = torch.tensor(ids, dtype=torch.int64)
        if not self.on_gpu:
            return index
        return index.pin_memory().to(self.device, non_blocking=True)

    def _record(self, kind: str, loads_into: set[int] | None = None,
                stores_from: set[int] | None = None, slots: set[int] | None = None,
                layered: bool = False) -> "torch.cuda.Event | None":
        """Marks the copies queued so far on the ``kind`` stream (on a GPU; None on the CPU,
        where they are done)."""
        if not self.streams:
            return None
        batch = _Batch(kind, torch.cuda.Event(enable_timing=True), self._copy_start,
                       self._copy_bytes, loads_into or set(), stores_from or set(),
                       slots or set(), layered)
        batch.event.record(self.streams[kind])
        self.batches.append(batch)
        return batch.event

    def _retire(self) -> None:
        """Forgets the batches that have landed, the oldest of each stream first."""
        blocked: set[str] = set()  # a stream whose oldest batch is still in flight
        still: deque[_Batch] = deque()
        for batch in self.batches:
            if batch.kind not in blocked and batch.event.query():
                self._count_copy(batch)
            else:
                blocked.add(batch.kind)
                still.append(batch)
        self.batches = still

    def _count_copy(self, batch: _Batch) -> None:
        """A finished batch's bytes and time on the copy stream (its copies alone: the start
        event fires once the stream gets to them), for the measured transfer rate."""
        if batch.start is not None:
            self._report.copied_bytes += batch.num_bytes
            self._report.copy_seconds += batch.start.elapsed_time(batch.event) / 1e3

    @contextlib.contextmanager
    def _timed(self, num_bytes: int) -> "Iterator[None]":
        """Around one batch of device <-> host copies: their bytes and time (the CPU's are
        done on return; a GPU's are timed by events on the copy stream, see ``_count_copy``)."""
        self._copy_bytes = num_bytes
        if self.streams:
            self._copy_start = torch.cuda.Event(enable_timing=True)
            self._copy_start.record(torch.cuda.current_stream())  # inside _on_copy_stream
            yield
            return
        started = time.perf_counter()
        yield
        self._report.copied_bytes += self._copy_bytes
        self._report.copy_seconds += time.perf_counter() - started

    def _wait_for(self, touched: Iterable[int], written: Iterable[int]) -> None:
        """The compute stream waits for the last in-flight copy of each stream it must not
        overtake (each stream is FIFO: waiting for it covers every copy before it); not for
        layered loads, which the forward waits for layer by layer (``gate``)."""
        written = set(written)
        used = written.union(touched)
        waited: set[str] = set()
        for batch in reversed(self.batches):
            if batch.layered or batch.kind in waited:
                continue
            if not (batch.loads_into.isdisjoint(used) and batch.stores_from.isdisjoint(written)):
                torch.cuda.current_stream().wait_event(batch.event)
                waited.add(batch.kind)

    def _host_ready(self, slot: int) -> None:
        """Before the CPU reads or writes a slot: the copies in flight on it have landed."""
        waited: set[str] = set()
        for batch in reversed(self.batches):
            if batch.kind not in waited and slot in batch.slots:
                batch.event.synchronize()
                waited.add(batch.kind)

    # -- host <-> another replica ------------------------------------------------------------

    def export(self, slots: list[int]) -> torch.Tensor:
        """A copy of the (pinned) slots, one row each, for another replica. Called beside the
        steps: it waits for every copy queued on the offload stream (a write-through into one
        of them may be in flight), not for the steps."""
        for stream in self.streams.values():
            stream.synchronize()
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
            self.disk.reuse(slot)
            self.host[slot].copy_(rows[row])


def stage_blocks_for(block_bytes: int, num_slots: int) -> int:
    """Blocks a staging batch holds: STAGE_BYTES of them, at least STAGE_BLOCKS, and no more
    than the host tier has slots (a step moves each slot once at most)."""
    return max(1, min(max(STAGE_BLOCKS, STAGE_BYTES // block_bytes), num_slots))


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


def blocks_in_use(step: StepInput, block_size: int) -> tuple[list[int], list[int]]:
    """(touched, written): the blocks a step's forward reads or writes, and those it writes
    (the first block not computed yet onwards): what ``before_step`` waits for."""
    touched, written = [], []
    new = {request.request_id: request for request in step.new_requests}
    for item in step.scheduled:
        request = new.get(item.request_id)
        if request is not None:
            touched += request.block_ids
            written += request.block_ids[item.num_computed_tokens // block_size:]
        written += item.new_block_ids
    return touched, written


def blocks_of_requests(request_ids: Iterable[str],
                       states: "Mapping[str, RequestState]") -> set[int]:
    """Every block of these requests (those still known): what a step of theirs still in
    flight may read or write."""
    return set().union(*(states[request_id].block_ids for request_id in request_ids
                         if request_id in states))
