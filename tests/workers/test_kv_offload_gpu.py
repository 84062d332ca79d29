"""The KV copies on a GPU: pinned host slots, a stream of their own, events. Bit-exact round
trips, the compute stream waiting for a copy only where it must, an engine with host and disk
tiers giving the tokens of one without them, and the copies' rate beside a plain pinned copy."""

import time

import pytest
import torch

from cluster.bench.roofline import median_seconds
from kvstore.block_hash import hash_block_tokens
from kvstore.transfers import BlockLoad, DiskRead, DiskWrite, KVTransfers
from tests.workers.test_kv_offload import stacked as stack_layers
from workers.attention.layer_cache import LayerKVCache
from workers.host_layout import layer_tensors
from workers.kv_offload import KVOffloader
from workers.layers.parallel import TensorParallelGroup

SINGLE = TensorParallelGroup.single()


def gpu_caches(dtype, num_blocks=64, layers=4, scales=False, shape=(16, 4, 64), stacked=True):
    """Random caches; ``stacked``: each kind one tensor over the layers, as the engine
    allocates them (workers/kv_cache.py), else a tensor a layer."""
    caches = separate_caches(dtype, num_blocks, layers, scales, shape)
    return stack_layers(caches) if stacked else caches


def separate_caches(dtype, num_blocks, layers, scales, shape):
    generator = torch.Generator(device="cuda").manual_seed(0)
    full = (num_blocks, *shape)

    def rand(size, kind):
        if kind == torch.int8:
            return torch.randint(-128, 128, size, generator=generator, dtype=torch.int8,
                                 device="cuda")
        return torch.randn(size, generator=generator, device="cuda").to(kind)

    if scales:
        return [LayerKVCache(rand(full, torch.int8), rand(full, torch.int8),
                             rand(full[:3], torch.float32), rand(full[:3], torch.float32))
                for _ in range(layers)]
    return [LayerKVCache(rand(full, dtype), rand(full, dtype)) for _ in range(layers)]


def bits(tensors, ids):
    return [t[ids].contiguous().view(torch.uint8).cpu() for t in tensors]


def run(offloader, transfers, touched=(), written=()):
    offloader.before_step(transfers, touched, written)
    offloader.after_step(transfers)
    return offloader


@pytest.mark.gpu
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per-layer"])
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "float16", "int8+scales"])
def test_device_host_device_and_disk_round_trips_are_bit_exact(kind, stacked, tmp_path):
    dtype = getattr(torch, kind.split("+")[0])
    tensors = layer_tensors(gpu_caches(dtype, scales=kind == "int8+scales", stacked=stacked))
    offloader = KVOffloader(tensors, num_slots=48, disk_dir=str(tmp_path), tp=SINGLE)
    kinds = 4 if kind == "int8+scales" else 2
    assert len(offloader.copies.groups) == (kinds if stacked else kinds * 4)
    assert offloader.host.is_pinned()
    blocks = list(range(0, 40))  # more than one staging batch, slots in two runs
    slots = list(range(40, 48)) + list(range(0, 32))
    original = bits(tensors, blocks)
    run(offloader, KVTransfers(stores=list(zip(blocks, slots, strict=True))))
    hashes = [hash_block_tokens(None, [b]) for b in blocks[:3]]
    run(offloader, KVTransfers(to_disk=[DiskWrite(s, h, (i,)) for i, (s, h) in
                                        enumerate(zip(slots[:3], hashes, strict=True))]))
    torch.cuda.synchronize()  # nothing of a test's own may race the copies
    offloader.host[slots[:3]] = 0  # the disk copies alone hold those three now
    for t in tensors:
        t.zero_()
    targets = list(range(63, 23, -1))
    run(offloader, KVTransfers(from_disk=[DiskRead(h, (i,), s) for i, (s, h) in
                                          enumerate(zip(slots[:3], hashes, strict=True))],
                               loads=[BlockLoad("r", slots, targets)]))
    assert offloader.report(idle=True).loaded == {"r": 40}
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(original, bits(tensors, targets), strict=True))


@pytest.mark.gpu
def test_a_block_written_by_the_step_waits_for_its_copy_to_the_host():
    tensors = layer_tensors(gpu_caches(torch.bfloat16, num_blocks=256, layers=8))
    offloader = KVOffloader(tensors, num_slots=256, disk_dir=None, tp=SINGLE)
    before = bits(tensors, list(range(256)))
    # every block is copied out, then the step writes all of them at once: the compute stream
    # must wait for the copies (they read the old values), and nothing else may wait
    transfers = KVTransfers(stores_first=[(b, b) for b in range(256)])
    started = time.perf_counter()
    offloader.before_step(transfers, touched=[], written=list(range(256)))
    queued = time.perf_counter() - started
    for t in tensors:
        t.fill_(1)  # the forward, on the compute stream
    torch.cuda.synchronize()
    host = [view.contiguous().view(torch.uint8) for view in offloader.host_views]
    assert all(torch.equal(a, b) for a, b in zip(before, host, strict=True))
    assert queued < 0.05  # queued, not waited for by the host


@pytest.mark.gpu
@pytest.mark.parametrize("busy", [{10, 11}, {10, 21}])
def test_a_load_starts_beside_the_step_in_flight_unless_that_step_uses_its_blocks(busy):
    """A step in flight (a long kernel on the compute stream) uses the blocks ``busy``: a load
    into blocks 20 and 21 lands before it ends when neither is among them, after it when one
    is (the pool may have handed that block out again while the step still reads it); the
    loaded bytes are the host slots' either way."""
    tensors = layer_tensors(gpu_caches(torch.bfloat16, num_blocks=64, layers=4))
    offloader = KVOffloader(tensors, num_slots=64, disk_dir=None, tp=SINGLE)
    run(offloader, KVTransfers(stores_first=[(0, 0), (1, 1)]))
    torch.cuda.synchronize()
    expected = bits(tensors, [0, 1])
    torch.cuda._sleep(500_000_000)  # the step in flight: ~0.25 s of GPU clock cycles
    step_done = torch.cuda.Event(enable_timing=True)
    step_done.record()
    offloader.before_step(KVTransfers(loads=[BlockLoad("r", [0, 1], [20, 21], in_step=True)]),
                          touched=[20, 21], written=[], busy=lambda: busy)
    load_done = offloader.pending_loads[-1].event
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(bits(tensors, [20, 21]), expected,
                                                  strict=True))
    landed_before_step_end = load_done.elapsed_time(step_done) > 0
    assert landed_before_step_end == busy.isdisjoint({20, 21})


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bfloat16", "int8+scales"])
def test_in_step_loads_go_layer_by_layer_and_land_bit_exact(kind):
    """The probe finds that the device reads pinned slots in place; a step's in-step loads
    go together, chunk by chunk, the forward's gate armed with the chunks after the first."""
    dtype = getattr(torch, kind.split("+")[0])
    tensors = layer_tensors(gpu_caches(dtype, layers=8, scales=kind == "int8+scales"))
    offloader = KVOffloader(tensors, num_slots=32, disk_dir=None, tp=SINGLE,
                            model_layers=(8, len(tensors)))
    assert offloader.pinned is not None
    expected = bits(tensors, [3, 9, 17])
    run(offloader, KVTransfers(stores_first=[(3, 5), (9, 6), (17, 20)]))
    torch.cuda.synchronize()
    for t in tensors:
        t.zero_()
    loads = KVTransfers(loads=[BlockLoad("a", [5, 6], [30, 31], in_step=True),
                               BlockLoad("b", [20], [40], in_step=True)])
    offloader.before_step(loads, touched=[30, 31, 40], written=[])
    assert [first for first, _ in offloader.gate.pending] == [1, 2, 3, 4, 5, 6, 7]
    offloader.after_step(loads)
    assert offloader.gate.pending == []
    torch.cuda.synchronize()
    assert offloader.report(idle=True).loaded == {"a": 2, "b": 1}
    assert all(torch.equal(a, b) for a, b in zip(bits(tensors, [30, 31, 40]), expected,
                                                  strict=True))
    assert not any(t[:30].any() for t in tensors)


@pytest.mark.gpu
def test_in_step_loads_keep_their_indices_while_the_compute_stream_allocates():
    """The load stream held back (a long kernel queued on it), the compute stream allocates
    and fills tensors of the index tensors' size class: the loads, once they run, still read
    their own slots and blocks (their indices live on the load stream's memory)."""
    tensors = layer_tensors(gpu_caches(torch.bfloat16, layers=8))
    offloader = KVOffloader(tensors, num_slots=32, disk_dir=None, tp=SINGLE,
                            model_layers=(8, len(tensors)), in_place=True)
    expected = bits(tensors, [3, 9, 17])
    run(offloader, KVTransfers(stores_first=[(3, 5), (9, 6), (17, 20)]))
    torch.cuda.synchronize()
    for t in tensors:
        t.zero_()
    with torch.cuda.stream(offloader.streams["load"]):
        torch.cuda._sleep(300_000_000)  # ~0.15 s of GPU clock cycles before the loads
    loads = KVTransfers(loads=[BlockLoad("a", [5, 6, 20], [30, 31, 40], in_step=True)])
    offloader.before_step(loads, touched=[], written=[], busy=lambda: set())
    garbage = [torch.full((3,), 10**12, dtype=torch.int64, device="cuda") for _ in range(256)]
    offloader.after_step(loads)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(bits(tensors, [30, 31, 40]), expected,
                                                  strict=True))
    del garbage


@pytest.mark.gpu
def test_an_engine_with_host_and_disk_tiers_gives_the_tokens_of_one_without(tiny_models,
                                                                             tmp_path):
    from cluster import LLM, SamplingParams

    prompts = [[(31 * p + 7 * i) % 990 + 5 for i in range(40 + p)] for p in range(12)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", block_size=4, num_kv_blocks=40,
                  max_num_seqs=4, enforce_eager=True)
    plain = LLM(str(tiny_models["llama"]), **common)
    want = [o.token_ids for o in plain.generate(prompts, greedy)]
    tiered = LLM(str(tiny_models["llama"]), host_kv_cache_gb=64 * 2048 / 2**30,
                 disk_kv_cache_dir=str(tmp_path), **common)
    # unpriced, every hit loads: a tiny model's loading steps cost more than recomputing, as
    # the engine measures them (router/live_rates.py), and most would recompute
    tiered.engine.scheduler.rates = tiered.engine.scheduler.loads.rates = None
    for order in (prompts, prompts[::-1], prompts):
        got = [o.token_ids for o in tiered.generate(order, greedy)]
        assert got == [want[prompts.index(p)] for p in order]
        tiered.engine.scheduler.kv.reset_prefix_cache()
        tiered.engine.scheduler.kv.check_integrity()
    stats = tiered.stats()
    assert stats.host_cache_hits > 0 and stats.disk_cache_hits > 0
    print(f"\nhits {stats.prefix_cache_hits} host {stats.host_cache_hits} "
          f"disk {stats.disk_cache_hits} preemptions {stats.num_preemptions}")


@pytest.mark.gpu
def test_the_copies_run_near_a_plain_pinned_copy_s_rate():
    # 256 blocks of a Llama-3.1-8B shard's shape: 32 layers x K, V x (16, 8, 128) bf16 = 2 MiB
    tensors = layer_tensors(gpu_caches(torch.bfloat16, num_blocks=512, layers=32,
                                       shape=(16, 8, 128)))
    offloader = KVOffloader(tensors, num_slots=256, disk_dir=None, tp=SINGLE)
    total = 256 * offloader.layout.block_bytes
    device = torch.empty(total, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)

    def timed(fn):  # GB/s
        return total / median_seconds(fn, torch.device("cuda"), repeats=5) / 1e9

    plain_d2h = timed(lambda: pinned.copy_(device, non_blocking=True))
    plain_h2d = timed(lambda: device.copy_(pinned, non_blocking=True))
    stores = KVTransfers(stores=[(b, s) for s, b in enumerate(range(0, 512, 2))])
    loads = KVTransfers(loads=[BlockLoad("r", list(range(256)), list(range(1, 512, 2)))])
    store_rate = timed(lambda: run(offloader, stores))
    load_rate = timed(lambda: (run(offloader, loads), offloader.report(idle=False)))
    layered = KVOffloader(tensors, num_slots=256, disk_dir=None, tp=SINGLE,
                          model_layers=(32, len(tensors)))
    in_step = KVTransfers(loads=[BlockLoad("r", list(range(256)), list(range(1, 512, 2)),
                                           in_step=True)])
    layered_rate = timed(lambda: (run(layered, in_step), layered.report(idle=False)))
    print(f"\nD2H {store_rate:.1f} GB/s of plain {plain_d2h:.1f}; "
          f"H2D {load_rate:.1f} GB/s of plain {plain_h2d:.1f}, layer by layer "
          f"{layered_rate:.1f}")
    assert store_rate > 0.5 * plain_d2h and load_rate > 0.5 * plain_h2d
    assert layered_rate > 0.5 * plain_h2d
