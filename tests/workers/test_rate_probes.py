"""workers/rate_probes.py: the start-up probes that price KV copies against recomputes. The load
probe's steps (its prefix written to host slots, then loaded back in the step that runs it
beside a prefill) on the CPU, the rates a worker reports, and on a GPU a measured loads' rate."""

import pytest
import torch

from kvstore.transfers import KVTransfers
from workers.rate_probes import ProbeShape, RateProbes
from workers.worker import Worker
from workers.worker_config import WorkerConfig

BLOCK = 16


def recorded_probes(worker, shape):
    """Probes of ``worker`` in ``shape``, and the list of the steps they run."""
    calls = []

    def execute(step):
        calls.append(step)
        return worker.execute(step)

    return RateProbes(execute, worker.states.clear, shape), calls


def test_the_load_probe_loads_its_stored_prefix_beside_a_prefill_and_leaves_nothing(
        tiny_models):
    worker = Worker(WorkerConfig(str(tiny_models["llama"]), max_num_batched_tokens=256,
                                 host_kv_cache_bytes=1 << 20))
    info = worker.init_kv_cache(64)
    assert info.load_bytes_per_s == 0.0  # the CPU's steps are not timed: no load probe
    assert info.prefill_tokens_per_s > 0 and info.copy_bytes_per_s > 0
    num_slots = 20
    calls = []

    def execute(step):
        calls.append(step)
        if step.transfers is not None and step.transfers.loads:  # only the load brings them
            for tensor in worker.offloader.tensors:
                tensor[list(range(8, 28))] = 0
        return worker.execute(step)

    probes = RateProbes(execute, worker.states.clear,
                        ProbeShape(BLOCK, 64, 256, 512, torch.device("cpu")))
    num_loaded, question, alone, with_load = probes.time_load(num_slots)
    # 128 tokens prefilled alone (8 blocks) and after the loaded prefix (8 more): 48 blocks
    # left of 64, 24 in the model's 512 positions, of which the 20 slots take all
    assert (num_loaded, question) == (20, 128) and alone > 0 and with_load > 0
    loaded = list(range(8, 28))
    # the prefix filled in chunks of the token budget, then written to slots 0..19
    assert [[(s.request_id, s.num_computed_tokens, s.num_new_tokens) for s in c.scheduled]
            for c in calls[:3]] == [[], [("probe", 0, 256)], [("probe", 256, 64)]]
    assert calls[1].new_requests == [] and calls[0].new_requests[0].block_ids == loaded
    assert calls[3].transfers.stores == [(block, slot) for slot, block in enumerate(loaded)]
    # each probe step twice: the 128 tokens alone, then after the loaded prefix, alone too
    assert [(s.request_id, s.num_computed_tokens, s.num_new_tokens) for s in calls[4].scheduled
            ] == [("probe", 0, 128)]
    step = calls[-1]
    assert [(s.request_id, s.num_computed_tokens, s.num_new_tokens) for s in step.scheduled] == [
        ("probe-load", 320, 128)]
    assert [r.block_ids for r in step.new_requests] == [list(range(8, 36))]
    (load,) = step.transfers.loads
    assert (load.host_slots, load.block_ids, load.in_step) == (list(range(20)), loaded, True)
    assert len(calls) == 8 and calls[4].transfers is None
    # the loaded blocks hold what the slots do, and no request is left behind
    for tensor, host in zip(worker.offloader.tensors, worker.offloader.host_views, strict=True):
        assert torch.equal(tensor[loaded], host[:20]) and host[:20].abs().sum() > 0
    assert worker.states == {}


def test_the_load_probe_keeps_to_the_model_s_length_and_the_pool(tiny_models):
    worker = Worker(WorkerConfig(str(tiny_models["llama"]), host_kv_cache_bytes=1 << 20,
                                 max_model_len=160))
    worker.init_kv_cache(32)
    probes, calls = recorded_probes(worker, ProbeShape(BLOCK, 32, 2048, 160, torch.device("cpu")))
    # a question of 128 tokens (8 blocks) after a prefix of 2 blocks: the model's 160 positions
    assert probes.time_load(num_slots=40)[:2] == (2, 128)
    assert [(s.request_id, s.num_computed_tokens, s.num_new_tokens)
            for s in calls[-1].scheduled] == [("probe-load", 32, 128)]
    assert worker.states == {}


def test_no_load_probe_where_the_pool_holds_none(tiny_models):
    worker = Worker(WorkerConfig(str(tiny_models["llama"]), host_kv_cache_bytes=1 << 20))
    worker.init_kv_cache(17)
    for num_blocks, num_loaded in ((17, 1), (16, None)):
        probes = RateProbes(worker.execute, worker.states.clear,
                            ProbeShape(BLOCK, num_blocks, 2048, 512, torch.device("cpu")))
        probe = probes.time_load(num_slots=40)
        # 8 question blocks alone, 8 after the prefix: one block to load into of 17, none of 16
        assert (probe[0] if probe else None) == num_loaded


def test_the_store_probe_times_a_prefill_alone_then_with_its_blocks_stored(tiny_models):
    worker = Worker(WorkerConfig(str(tiny_models["llama"]), max_num_batched_tokens=200,
                                 host_kv_cache_bytes=1 << 20))
    info = worker.init_kv_cache(64)
    assert info.store_seconds_per_block == 0.0  # the CPU's steps are not timed: no probe
    probes, calls = recorded_probes(worker, ProbeShape(BLOCK, 64, 200, 512, torch.device("cpu")))
    assert probes.store_seconds(num_slots=20) == 0.0 and calls == []
    for tensor in worker.offloader.host_views:
        tensor.zero_()
    num_blocks, alone, stored = probes.time_store(num_slots=20)
    # full blocks of the 200-token budget (12 of 16 tokens), all of which the slots hold
    assert num_blocks == 12 and alone > 0 and stored > 0
    assert [[(s.request_id, s.num_computed_tokens, s.num_new_tokens) for s in c.scheduled]
            for c in calls] == [[("probe", 0, 192)]] * 4
    assert [c.transfers for c in calls[:2]] == [None, None]
    assert calls[3].transfers == KVTransfers(stores=[(block, block) for block in range(12)])
    for tensor, host in zip(worker.offloader.tensors, worker.offloader.host_views, strict=True):
        assert torch.equal(tensor[:12], host[:12]) and host[:12].abs().sum() > 0
    assert worker.states == {}
    # a pool, a buffer or a budget without a full block: no probe
    assert probes.time_store(num_slots=0) is None
    assert recorded_probes(worker, ProbeShape(BLOCK, 64, 15, 512, torch.device("cpu")))[
        0].time_store(num_slots=20) is None


@pytest.mark.gpu
def test_a_gpu_worker_measures_what_loading_adds_to_a_step(tiny_models):
    worker = Worker(WorkerConfig(str(tiny_models["llama"]), device="cuda",
                                 host_kv_cache_bytes=1 << 24, enforce_eager=True))
    info = worker.init_kv_cache(512)
    assert 0 < info.load_bytes_per_s <= info.copy_bytes_per_s * 1.0001
    # a block's store: its copy out of at most a few ms (a tiny block, mostly the launch)
    assert 0 <= info.store_seconds_per_block < 5e-3
    assert worker.states == {} and worker.step_timer.take() == []
    assert worker.offloader.report(idle=False).is_empty
