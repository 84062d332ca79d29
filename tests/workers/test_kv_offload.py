"""A shard's KV copies between its device cache (the CPU here), host slots and block files:
bit-exact round trips for every cache dtype and a quantized layout, refused files, and the
shards of a tensor-parallel group agreeing on what failed."""

import pytest
import torch
import torch.multiprocessing as mp

from kvstore.block_file import block_file_name
from kvstore.block_hash import hash_block_tokens
from kvstore.transfers import BlockLoad, DiskRead, DiskWrite, KVTransfers
from tests.workers.gloo_group import gloo_group
from workers.attention.layer_cache import LayerKVCache
from workers.host_layout import BlockLayout, layer_tensors
from workers.kv_offload import (
    STAGE_BLOCKS,
    STAGE_BYTES,
    KVOffloader,
    blocks_of_requests,
    stage_blocks_for,
)
from workers.layers.parallel import TensorParallelGroup

NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM = 8, 4, 2, 8


def caches(dtype, seed=0, layers=2, scales=False):
    """Random per-layer caches; ``scales``: an int8 cache with per-token scales, the layout a
    quantized cache has (every tensor indexed by block along dim 0)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, HEADS, DIM)

    def rand(*size, kind=dtype):
        if kind == torch.int8:
            return torch.randint(-128, 128, size, generator=generator, dtype=torch.int8)
        return torch.randn(size, generator=generator).to(kind)

    if scales:
        return [LayerKVCache(rand(*shape, kind=torch.int8), rand(*shape, kind=torch.int8),
                             rand(*shape[:3], kind=torch.float16),
                             rand(*shape[:3], kind=torch.float16))
                for _ in range(layers)]
    return [LayerKVCache(rand(*shape), rand(*shape)) for _ in range(layers)]


def bits(tensor):
    return tensor.contiguous().view(torch.uint8)


def blocks_of(tensors, ids):
    return [bits(t[ids]) for t in tensors]


def step(offloader, transfers):
    """One step whose block files are all written and read before its report (the disk
    thread's work is the step's here, to assert on it)."""
    offloader.before_step(transfers, [], [])
    offloader.after_step(transfers)
    offloader.flush()
    return offloader.report(idle=False)


def hashes(n):
    return [hash_block_tokens(None, [i]) for i in range(n)]


def test_every_tensor_of_a_layer_is_copied_including_a_quantized_cache_s_scales():
    kv = caches(torch.int8, scales=True)
    tensors = layer_tensors(kv)
    assert len(tensors) == 8  # K, V, K scales, V scales per layer
    layout = BlockLayout.of(tensors, tp_size=1)
    data, scale = BLOCK_SIZE * HEADS * DIM, BLOCK_SIZE * HEADS * 2  # float16 scales
    assert layout.sizes == (data, data, scale, scale) * 2
    assert layout.block_bytes == 2 * (2 * data + 2 * scale)


def round_trip_through_the_host(kv):
    tensors = layer_tensors(kv)
    offloader = KVOffloader(tensors, num_slots=4, disk_dir=None, tp=TensorParallelGroup.single())
    originals = blocks_of(tensors, [5, 2, 7])
    step(offloader, KVTransfers(stores=[(5, 3), (2, 0), (7, 1)]))
    for t in tensors:
        t.zero_()
    report = step(offloader, KVTransfers(loads=[BlockLoad("r", [3, 0, 1], [1, 4, 6])]))
    assert report.loaded == {"r": 3} and report.failed_reads == []
    assert all(torch.equal(a, b) for a, b in zip(originals, blocks_of(tensors, [1, 4, 6]),
                                                 strict=True))
    # the blocks not loaded into stay as they were (zero)
    assert all(not bits(t[[0, 2, 3, 5, 7]]).any() for t in tensors)
    return len(offloader.copies.groups)


def stacked(kv):
    """The same caches as the engine allocates them: each kind one tensor over the layers."""
    def stack(kind):
        tensors = [getattr(layer, kind) for layer in kv]
        return None if tensors[0] is None else torch.stack(tensors)

    k, v, k_scale, v_scale = (stack(kind) for kind in ("k", "v", "k_scale", "v_scale"))
    return [LayerKVCache(k[i], v[i], None if k_scale is None else k_scale[i],
                         None if v_scale is None else v_scale[i]) for i in range(len(kv))]


@pytest.mark.parametrize("layout", [list, stacked], ids=["per-layer", "stacked"])
def test_device_to_host_to_device_is_bit_exact_for_every_cache_dtype(layout):
    one_each = layout is list  # else a gather per kind over both layers
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert round_trip_through_the_host(layout(caches(dtype, seed=1))) == (
            4 if one_each else 2)
    assert round_trip_through_the_host(layout(caches(torch.int8, seed=2, scales=True))) == (
        8 if one_each else 4)


def test_more_blocks_than_a_staging_batch_in_scattered_slots_round_trip_exactly():
    generator = torch.Generator().manual_seed(5)
    tensors = [torch.randn((80, BLOCK_SIZE, HEADS, DIM), generator=generator).to(torch.bfloat16)
               for _ in range(4)]
    offloader = KVOffloader(tensors, num_slots=48, disk_dir=None, tp=TensorParallelGroup.single(),
                            stage_blocks=16)
    blocks = list(range(0, 80, 2))  # 40 blocks, more than one batch
    slots = list(range(40, 48)) + list(range(31, -1, -1))  # runs up, and slots in reverse
    originals = blocks_of(tensors, blocks)
    step(offloader, KVTransfers(stores=list(zip(blocks, slots, strict=True))))
    for t in tensors:
        t.zero_()
    targets = list(range(79, 39, -1))
    assert step(offloader, KVTransfers(loads=[BlockLoad("r", slots, targets)])).loaded == {
        "r": 40}
    assert all(torch.equal(a, b) for a, b in zip(originals, blocks_of(tensors, targets),
                                                 strict=True))
    assert all(not bits(t[:40]).any() for t in tensors)  # nothing else was written


def test_a_staging_batch_holds_its_bytes_in_blocks_of_any_size_within_the_host_tier():
    small, large = 192 << 10, 2 << 20  # the Qwen2.5-0.5B and Llama-3.1-8B shapes' blocks
    assert stage_blocks_for(small, 10**5) == STAGE_BYTES // small == 341
    assert stage_blocks_for(large, 10**5) == STAGE_BLOCKS == 64  # 128 MiB: never fewer
    assert stage_blocks_for(small, 100) == 100  # a step moves each slot once at most
    tensors = layer_tensors(caches(torch.float32))
    offloader = KVOffloader(tensors, num_slots=6, disk_dir=None, tp=TensorParallelGroup.single())
    assert offloader.stage_blocks == 6
    assert offloader.stages["load"].shape == (6, offloader.layout.block_bytes)


def test_device_to_host_to_disk_and_back_is_bit_exact(tmp_path):
    for dtype in (torch.float32, torch.bfloat16):
        tensors = layer_tensors(caches(dtype, seed=3))
        offloader = KVOffloader(tensors, num_slots=2, disk_dir=str(tmp_path),
                                tp=TensorParallelGroup.single())
        h = hashes(2)
        originals = blocks_of(tensors, [6, 3])
        step(offloader, KVTransfers(stores=[(6, 0), (3, 1)]))
        step(offloader, KVTransfers(to_disk=[DiskWrite(0, h[0], (10, 11)),
                                             DiskWrite(1, h[1], (12, 13))]))
        offloader.host.zero_()
        for t in tensors:
            t.zero_()
        # the files come back into other slots, then into other blocks
        report = step(offloader, KVTransfers(
            from_disk=[DiskRead(h[1], (12, 13), 0), DiskRead(h[0], (10, 11), 1)],
            loads=[BlockLoad("r", [1, 0], [0, 1])]))
        assert report.loaded == {"r": 2} and report.failed_reads == []
        assert all(torch.equal(a, b) for a, b in zip(originals, blocks_of(tensors, [0, 1]),
                                                     strict=True))
        directory = tmp_path / offloader.layout.tag
        assert sorted(p.name for p in directory.iterdir()) == sorted(
            block_file_name(x, 0, 1) for x in h)


def test_a_refused_file_ends_its_load_there_and_is_reported(tmp_path):
    tensors = layer_tensors(caches(torch.float32, seed=4))
    offloader = KVOffloader(tensors, num_slots=3, disk_dir=str(tmp_path),
                            tp=TensorParallelGroup.single())
    h = hashes(3)
    step(offloader, KVTransfers(stores=[(0, 0), (1, 1), (2, 2)]))
    step(offloader, KVTransfers(to_disk=[DiskWrite(i, h[i], (i,)) for i in range(3)]))
    path = tmp_path / offloader.layout.tag / block_file_name(h[1], 0, 1)
    path.write_bytes(path.read_bytes()[:-8])  # torn
    before = blocks_of(tensors, [4, 5])
    report = step(offloader, KVTransfers(
        from_disk=[DiskRead(h[i], (i,), i) for i in range(3)],
        loads=[BlockLoad("r", [0, 1, 2], [3, 4, 5])]))
    assert report.loaded == {"r": 1} and report.failed_reads == [h[1]]
    assert all(torch.equal(a, b) for a, b in zip(blocks_of(tensors, [0]),
                                                 blocks_of(tensors, [3]), strict=True))
    # blocks 4 and 5 were not written: the failed block and the one after it are recomputed
    assert all(torch.equal(a, b) for a, b in zip(before, blocks_of(tensors, [4, 5]),
                                                 strict=True))


def test_a_failing_disk_is_reported_once_and_no_file_is_written_after(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")  # the tier's directory cannot be made under a file
    tensors = layer_tensors(caches(torch.float32))
    offloader = KVOffloader(tensors, num_slots=2, disk_dir=str(blocker),
                            tp=TensorParallelGroup.single())
    h = hashes(2)
    step(offloader, KVTransfers(stores=[(0, 0)]))
    first = step(offloader, KVTransfers(to_disk=[DiskWrite(0, h[0], (0,))]))
    second = step(offloader, KVTransfers(to_disk=[DiskWrite(0, h[1], (1,))]))
    assert first.disk_error == "writing a block file failed (Not a directory)"
    assert second.disk_error is None and offloader.disk_failed


def run_rank(rank: int, folder: str, results) -> None:
    with gloo_group(rank, 2, folder + "/store") as tp:
        tensors = layer_tensors(caches(torch.float32, seed=10 + rank))  # each rank's shard
        offloader = KVOffloader(tensors, num_slots=2, disk_dir=folder, tp=tp)
        h = hashes(2)
        original = blocks_of(tensors, [1])
        step(offloader, KVTransfers(stores=[(1, 0), (2, 1)]))
        step(offloader, KVTransfers(to_disk=[DiskWrite(0, h[0], (0,)),
                                             DiskWrite(1, h[1], (1,))]))
        directory = offloader.directory
        if rank == 1:  # only rank 1's file of block 1 is corrupt
            path = directory / block_file_name(h[1], 1, 2)
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
        tp.all_true(True, torch.device("cpu"))  # rank 1 has damaged its file
        for t in tensors:
            t.zero_()
        report = step(offloader, KVTransfers(
            from_disk=[DiskRead(h[0], (0,), 1), DiskRead(h[1], (1,), 0)],
            loads=[BlockLoad("r", [1, 0], [5, 6])]))
        results[rank] = {
            "loaded": report.loaded, "failed": report.failed_reads,
            "exact": all(torch.equal(a, b) for a, b in zip(original, blocks_of(tensors, [5]),
                                                           strict=True)),
            "files": sorted(p.name for p in directory.iterdir() if p.suffix == ".kv"),
        }


def test_shards_keep_their_own_files_and_agree_on_a_refused_one(tmp_path):
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(run_rank, args=(str(tmp_path), results), nprocs=2)
        results = dict(results)
    h = hashes(2)
    files = sorted(block_file_name(x, rank, 2) for x in h for rank in range(2))
    # rank 0's file of block 1 was fine, but a block is only as good as every shard of it
    expected = {"loaded": {"r": 1}, "failed": [h[1]], "exact": True, "files": files}
    assert results == {0: expected, 1: expected}


def test_a_failed_copy_fails_the_step_of_a_load_whose_sequence_runs_in_it(monkeypatch):
    tensors = layer_tensors(caches(torch.float32))
    offloader = KVOffloader(tensors, num_slots=4, disk_dir=None, tp=TensorParallelGroup.single())

    def broken(load, failed_slots, in_flight=None):  # type: ignore[no-untyped-def]
        raise RuntimeError("copy failed")

    monkeypatch.setattr(offloader, "_load", broken)
    # a load that waits beside the step is reported with no block intact (recomputed) ...
    assert step(offloader, KVTransfers(loads=[BlockLoad("r", [0], [1])])).loaded == {"r": 0}
    # ... one whose sequence's forward is this step's fails the step, naming it
    with pytest.raises(RuntimeError, match=r"loading 1 KV blocks from the host tier for s, "
                                           r"which runs in this step, failed: copy failed"):
        step(offloader, KVTransfers(loads=[BlockLoad("s", [0], [1], in_step=True)]))


def test_the_blocks_of_a_step_in_flight_are_every_block_of_its_known_sequences():
    class Table:
        def __init__(self, block_ids):
            self.block_ids = block_ids

    tables = {"a": Table([3, 7, 9]), "b": Table([9, 2]), "c": Table([5])}
    # "gone" was released before this was asked: nothing of it is known any more
    assert blocks_of_requests(["a", "b", "gone"], tables) == {2, 3, 7, 9}
    assert blocks_of_requests([], tables) == set()


def test_on_the_cpu_no_load_asks_which_blocks_are_in_flight():
    """Every copy there is done when it returns: nothing runs beside a step to wait for."""
    tensors = layer_tensors(caches(torch.float32))
    offloader = KVOffloader(tensors, num_slots=4, disk_dir=None, tp=TensorParallelGroup.single())
    def busy():
        raise AssertionError("asked on the CPU")

    offloader.before_step(KVTransfers(stores_first=[(1, 0)]), [], [])
    offloader.before_step(KVTransfers(loads=[BlockLoad("r", [0], [2], in_step=True)]), [2], [],
                          busy=busy)
    assert torch.equal(bits(tensors[0][2]), bits(tensors[0][1]))
    assert offloader.report(idle=False).loaded == {"r": 1}
