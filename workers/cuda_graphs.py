"""CUDA graphs for pure-decode steps: captured once per batch-size bucket, replayed each step.

A decode step of a small model is hundreds of short kernels; launched from Python, their
launch cost exceeds their run time. Replaying a captured graph launches them all at once.

A graph fixes its tensors' addresses and shapes, so each bucket B runs on static input buffers
of B rows. A batch of n <= B sequences fills the first n rows; the padding rows get slot -1
(store_kv skips them) and seq_len 0 (decode attention writes zeros), so they touch nothing::

    rows:       [ seq 0 | seq 1 | ... | seq n-1 | pad ... pad ]     (B rows in all)
    slot:       [  s0   |  s1   | ... |  s_n-1  |  -1 ...  -1 ]
    seq_len:    [  l0   |  l1   | ... |  l_n-1  |   0 ...   0 ]
    order:      the B rows, longest seq_len first (the padding rows last)

The decode kernel's split count is fixed per bucket at capture (chosen for the longest
context), since ``max_seq_len`` changes every step and the graph cannot follow it.
Host inputs go through one pinned buffer and one non-blocking copy per step.

Under tensor parallelism the graphs hold the layers' NCCL all-reduces (NCCL >= 2.9.6 can be
captured). That is sound because every rank runs the same steps: each captures the same buckets
in the same order, and each replays the same bucket each step. Whether to replay is decided
once for all ranks (``capture_on_every_rank``): graphs on every rank, or on none.
"""

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from workers.attention.metadata import AttentionMetadata, longest_first
from workers.attention.triton_backend import num_sms
from workers.attention.triton_decode import choose_num_splits
from workers.input_batch import DecodeRows
from workers.layers.parallel import TensorParallelGroup

log = logging.getLogger(__name__)

# up to 512 rows: a quantized cache holds ~2x the sequences of bf16's (W6: 355 of 4,608 tokens
# at the Llama-3.1-8B shape); a step past the largest bucket runs eagerly
MAX_CAPTURE_SIZE = 512
NUM_FIELDS = 5  # input_ids, positions, slots, seq_lens, decode order; then the block table
MIN_NCCL_FOR_CAPTURE = (2, 9, 6)  # the first NCCL whose collectives a CUDA graph can capture


def capture_sizes(max_num_seqs: int, cap: int = MAX_CAPTURE_SIZE) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to the first size >= min(max_num_seqs, cap)."""
    limit = max(1, min(max_num_seqs, cap))
    sizes = []
    for size in [1, 2, 4, *range(8, cap + 8, 8)]:
        sizes.append(size)
        if size >= limit:
            break
    return sizes


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size holding num_seqs rows; None when none does."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


def packed_size(bucket: int, width: int) -> int:
    return NUM_FIELDS * bucket + bucket * width


def pack_padded(rows: DecodeRows, bucket: int, out: np.ndarray | None = None) -> np.ndarray:
    """The step's inputs padded to ``bucket`` rows, as one flat int64 array::

        [ input_ids (B) | positions (B) | slots (B) | seq_lens (B) | order (B) | table (B x W) ]

    W is the widest block table of the step. Padding rows: token 0, position 0, slot -1,
    seq_len 0, blocks 0. ``order`` is the decode kernel's row order (``longest_first``).
    """
    n, width = rows.block_tables.shape
    size = packed_size(bucket, width)
    packed = np.empty(size, dtype=np.int64) if out is None else out[:size]
    fields = packed[: NUM_FIELDS * bucket].reshape(NUM_FIELDS, bucket)
    fields[:, n:] = 0
    fields[2, n:] = -1
    fields[0, :n] = rows.input_ids
    fields[1, :n] = rows.positions
    fields[2, :n] = rows.slots
    fields[3, :n] = rows.seq_lens
    fields[4] = longest_first(fields[3])
    table = packed[NUM_FIELDS * bucket :].reshape(bucket, width)
    table[:n] = rows.block_tables
    table[n:] = 0
    return packed


@dataclass
class StaticInputs:
    """The device buffers every graph reads; a bucket of B rows uses the first B.

    The fields live as rows of two matrices, one per dtype, so that a step's inputs arrive
    in three copies (the int64 fields, the int32 fields, the block table) rather than one a
    field: each copy is a kernel of ~1 µs ahead of a batch-1 step's graph."""

    ints64: torch.Tensor  # (3, max_B): input_ids, positions, slot_mapping
    ints32: torch.Tensor  # (2, max_B): seq_lens, decode order
    block_tables: torch.Tensor  # (max_B, max_blocks) int32
    query_start_loc: torch.Tensor  # (max_B + 1,) int32: 0, 1, 2, ... (one token a row)

    @classmethod
    def allocate(cls, max_batch: int, max_blocks: int, device: torch.device) -> "StaticInputs":
        ints64 = torch.zeros(3, max_batch, dtype=torch.int64, device=device)
        ints64[2].fill_(-1)
        ints32 = torch.zeros(2, max_batch, dtype=torch.int32, device=device)
        ints32[1] = torch.arange(max_batch, dtype=torch.int32, device=device)
        return cls(ints64, ints32,
                   torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device),
                   torch.arange(max_batch + 1, dtype=torch.int32, device=device))

    @property
    def input_ids(self) -> torch.Tensor:
        return self.ints64[0]

    @property
    def positions(self) -> torch.Tensor:
        return self.ints64[1]

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.ints64[2]

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.ints32[0]

    @property
    def decode_order(self) -> torch.Tensor:
        return self.ints32[1]

    def load(self, packed: torch.Tensor, bucket: int, width: int) -> None:
        """Scatter a packed step (on the device) into the first ``bucket`` rows."""
        fields, table = packed.split([NUM_FIELDS * bucket, bucket * width])
        fields = fields.view(NUM_FIELDS, bucket)
        self.ints64[:, :bucket].copy_(fields[:3])
        self.ints32[:, :bucket].copy_(fields[3:])
        # columns past `width` keep stale blocks: nothing reads past a row's seq_len
        self.block_tables[:bucket, :width].copy_(table.view(bucket, width))

    def metadata(self, bucket: int, max_seq_len: int, num_splits: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_lens_cpu=[1] * bucket,
            seq_lens_cpu=[max_seq_len] * bucket,
            decode_num_splits=num_splits,
            # one row has nothing to order: its kernel skips the extra load
            decode_order=self.decode_order[:bucket] if bucket > 1 else None,
        )


class DecodeGraphs:
    """One captured forward per bucket; ``run`` replays the one that fits a decode step."""

    def __init__(self, model, kv_caches, max_num_seqs: int, max_model_len: int,
                 block_size: int, device: torch.device) -> None:
        self.model, self.kv_caches, self.device = model, kv_caches, device
        self.sizes = capture_sizes(max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        self.inputs = StaticInputs.allocate(self.sizes[-1], self.max_blocks, device)
        max_packed = packed_size(self.sizes[-1], self.max_blocks)
        self.host = torch.zeros(max_packed, dtype=torch.int64).pin_memory()
        self.host_np = self.host.numpy()
        self.packed = torch.zeros(max_packed, dtype=torch.int64, device=device)
        self.copied = torch.cuda.Event()  # the pinned buffer is free again once this fires
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # an EAGLE-3 head's features (the model's aux_features), when the model keeps them:
        # each bucket's own static tensor, handed back after its replay
        self.aux: dict[int, torch.Tensor] = {}

    def num_splits(self, bucket: int) -> int:
        kv_heads = self.kv_caches[0].num_kv_heads
        return choose_num_splits(bucket, kv_heads, self.max_model_len, num_sms(self.device))

    def args(self, bucket: int) -> tuple:
        meta = self.inputs.metadata(bucket, self.max_model_len, self.num_splits(bucket))
        return self.inputs.input_ids[:bucket], self.inputs.positions[:bucket], self.kv_caches, meta

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One eager forward per bucket: compiles the Triton kernels, sets up cuBLAS and (under
        tensor parallelism) NCCL's channels outside any capture. The inputs are all padding,
        so nothing is written to the cache. Runs collectives: every rank calls it, or none."""
        for bucket in reversed(self.sizes):
            self.model(*self.args(bucket))
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def capture(self, capture_error_mode: str = "global") -> str | None:
        """Captures every bucket, largest first, all sharing one memory pool; returns why it
        failed, or None. Capturing launches no kernel, so a rank failing here leaves no other
        rank waiting in a collective; the ranks agree afterwards (``capture_on_every_rank``)."""
        try:
            pool = torch.cuda.graph_pool_handle()
            for bucket in reversed(self.sizes):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode=capture_error_mode):
                    self.outputs[bucket] = self.model(*self.args(bucket))
                self.graphs[bucket] = graph
                inner = getattr(self.model, "model", None)
                if getattr(inner, "aux_layers", ()):
                    self.aux[bucket] = inner.aux_features
            torch.cuda.synchronize(self.device)
        except Exception as error:  # noqa: BLE001 - any failure means: run eagerly
            self.graphs.clear()
            self.outputs.clear()
            self.aux.clear()
            return f"capture failed: {error!r}"
        return None

    def run(self, rows: DecodeRows, input_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Hidden states (n, hidden) of the step's n sequences, or None when no graph fits.
        ``input_ids`` (n,) on the device, when given, replace the rows' host tokens."""
        n, width = rows.block_tables.shape
        bucket = bucket_for(n, self.sizes)
        if bucket is None or width > self.max_blocks:
            return None
        self.copied.synchronize()  # the last step's copy has left the pinned buffer
        packed = pack_padded(rows, bucket, self.host_np)
        size = packed.size
        self.packed[:size].copy_(self.host[:size], non_blocking=True)
        self.copied.record()
        self.inputs.load(self.packed[:size], bucket, width)
        if input_ids is not None:
            self.inputs.input_ids[:n].copy_(input_ids)
        gate = getattr(getattr(self.model, "model", None), "layer_gate", None)
        if gate is not None:  # a graph's layers don't wait one by one: all of it first
            gate.wait_all()
        self.graphs[bucket].replay()
        if bucket in self.aux:  # what an eager forward would have left there
            self.model.model.aux_features = self.aux[bucket][:n]
        return self.outputs[bucket][:n]


def nccl_version_tuple(version: int | tuple[int, ...]) -> tuple[int, ...]:
    """torch.cuda.nccl.version() as (major, minor, patch); old torch returns one int code."""
    if isinstance(version, tuple):
        return version
    if version >= 10000:  # NCCL >= 2.9: major * 10000 + minor * 100 + patch
        return (version // 10000, version // 100 % 100, version % 100)
    return (version // 1000, version // 100 % 10, version % 100)


def collective_capture_problem(tp_size: int,
                               nccl_version: int | tuple[int, ...] | None) -> str | None:
    """Why this rank's NCCL cannot be captured in a graph, or None (always None for one rank)."""
    if tp_size == 1:
        return None
    if nccl_version is None:
        return "no NCCL to capture collectives with"
    version = nccl_version_tuple(nccl_version)
    if version < MIN_NCCL_FOR_CAPTURE:
        return f"NCCL {'.'.join(map(str, version))} cannot capture collectives (needs >= 2.9.6)"
    return None


def capture_on_every_rank(make_graphs: Callable[[], "DecodeGraphs"], tp: TensorParallelGroup,
                          device: torch.device,
                          nccl_version: Callable[[], object] = lambda: torch.cuda.nccl.version(),
                          ) -> "DecodeGraphs | None":
    """The decode graphs if every rank of the group captured them, else None on every rank.

    Under tensor parallelism a graph holds NCCL collectives: a rank replaying one while another
    runs eagerly would issue collectives that never match (a hang, or silent garbage). So the
    ranks agree twice, each time by a MIN all-reduce of a success flag that every rank joins:

        set up (buffers, NCCL check) -> agree -> warm up (eager, collectives) -> capture
        (records only) -> agree -> serve with graphs, or drop them everywhere

    The warm-up runs only once all ranks can run it, so its collectives always match.
    """
    graphs, problem = None, None
    try:
        graphs = make_graphs()
        problem = collective_capture_problem(tp.size, nccl_version() if tp.size > 1 else None)
    except Exception as error:  # noqa: BLE001 - any failure means: run eagerly
        problem = f"setup failed: {error!r}"
    if tp.all_true(problem is None, device):
        graphs.warm_up()
        # thread-local capture under TP: NCCL's watchdog thread may query events meanwhile
        problem = graphs.capture("thread_local" if tp.size > 1 else "global")
        if tp.all_true(problem is None, device):
            return graphs
    log.warning("rank %d: decode CUDA graphs off on all %d rank(s), every step runs eagerly: "
                "%s", tp.rank, tp.size, problem or "another rank could not capture")
    del graphs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return None
