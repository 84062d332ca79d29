"""The engine with KV tiers, on the CPU in float32: a device pool far smaller than the working
set, greedy output equal to transformers', repeats served from the host tier (loaded by the
step that runs them) and from disk (exact token counts), a second engine reading the first
one's disk tier, swap preemption, refused block files, a disk that fails mid-run, bad
configuration, and loads turned into recomputes once their steps are measured to cost more."""

import logging
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster import LLM, SamplingParams
from kvstore.block_file import block_file_name
from kvstore.block_hash import hash_full_blocks
from kvstore.transfers import StepCost
from workers.step_timer import loaded_blocks, prompt_tokens

BS = 4  # tokens per block
BLOCK_BYTES = 2048  # the tiny llama's block: 2 layers x K and V x 4 tokens x 2 heads x 16 x 4 B
# eight distinct prompts of 18 to 25 tokens: 4 to 6 full blocks each before their last token
PROMPTS = [[(37 * p + 11 * i) % 990 + 5 for i in range(18 + p)] for p in range(8)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
FINDABLE = sum((len(p) - 1) // BS * BS for p in PROMPTS)  # prompt tokens in full blocks


def gib(blocks: int) -> float:
    return blocks * BLOCK_BYTES / (1 << 30)


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def expected(model):
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    return [hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False,
                        attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
            for p in PROMPTS]


def engine(model, **options):
    """12 blocks of 4 tokens, for a working set of some 70: one of these sequences at a time
    (exact hit counts: nobody is preempted and counted twice), unless ``max_num_seqs`` says
    otherwise (two start at once, then grow past the pool)."""
    options = {"max_num_seqs": 1, **options}
    return LLM(str(model), device="cpu", dtype="float32", block_size=BS, num_kv_blocks=12,
               **options)


def generate(llm, reverse=False):
    """The prompts' greedy tokens, in the prompts' order (run in reverse order if asked)."""
    order = PROMPTS[::-1] if reverse else PROMPTS
    tokens = [out.token_ids for out in llm.generate(order, GREEDY)]
    llm.engine.scheduler.kv.check_integrity()  # device pool and every tier
    return tokens[::-1] if reverse else tokens


def hits(llm):
    stats = llm.stats()
    return stats.prefix_cache_hits, stats.host_cache_hits, stats.disk_cache_hits


def test_repeats_are_served_from_the_host_tier(model, expected):
    llm = engine(model, host_kv_cache_gb=gib(100))
    assert llm.engine.scheduler.kv.tiers.host.num_slots == 100
    assert generate(llm) == expected
    assert hits(llm) == (0, 0, 0)  # distinct prompts
    llm.engine.scheduler.kv.reset_prefix_cache()  # the device forgets every prefix
    before = hits(llm)
    assert generate(llm) == expected
    after = hits(llm)
    # every prompt's full blocks but the one holding its last token, from the host tier
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (
        FINDABLE, FINDABLE, 0)
    snapshot = llm.engine.metrics_snapshot()
    assert snapshot.kv_offloaded_bytes["disk"] == snapshot.kv_loaded_bytes["disk"] == 0
    assert snapshot.kv_offloaded_bytes["host"] % BLOCK_BYTES == 0
    assert snapshot.kv_loaded_bytes["host"] >= after[1] // BS * BLOCK_BYTES
    assert snapshot.kv_load_latency.count > 0


def test_a_host_hit_is_loaded_by_the_step_that_runs_it(model, expected):
    llm = engine(model, host_kv_cache_gb=gib(100))
    generate(llm)
    llm.engine.scheduler.kv.reset_prefix_cache()
    steps = []
    execute = llm.engine.executor.execute
    llm.engine.executor.execute = lambda step: steps.append(step) or execute(step)
    assert [out.token_ids for out in llm.generate(PROMPTS[:1], GREEDY)] == expected[:1]
    first = steps[0]  # the load and the sequence's remaining prompt token, in one step
    loaded = (len(PROMPTS[0]) - 1) // BS
    assert [(load.in_step, len(load.block_ids)) for load in first.transfers.loads] == [
        (True, loaded)]
    assert [(item.num_computed_tokens, item.num_new_tokens) for item in first.scheduled] == [
        (loaded * BS, len(PROMPTS[0]) - loaded * BS)]
    assert first.transfers.loads[0].block_ids == first.new_requests[0].block_ids[:loaded]


def test_preempted_sequences_resume_from_the_host_tier(model, expected):
    llm = engine(model, host_kv_cache_gb=gib(100), max_num_seqs=8)
    assert generate(llm) == expected
    # the prompts are distinct: what the host tier served was the prefix of a preempted
    # sequence coming back (swap preemption), not recomputed
    stats = llm.stats()
    assert stats.num_preemptions > 0 and stats.host_cache_hits > 0


def test_a_load_is_told_the_blocks_the_step_before_may_still_use(model, expected):
    """With async scheduling the step before may still run on the device when a load is
    issued: the workers tell the offloader which blocks that step uses (every block the
    scheduler had allotted its sequences), and on a GPU a load into none of them starts at
    once (workers/kv_offload.py). A host hit arriving while another sequence decodes: its
    load is told exactly that sequence's blocks, and both answers are transformers'."""
    llm = LLM(str(model), device="cpu", dtype="float32", block_size=BS, num_kv_blocks=64,
              host_kv_cache_gb=gib(100), max_num_seqs=4, async_scheduling=True)
    generate(llm)  # every prompt's full blocks reach the host tier
    llm.engine.scheduler.kv.reset_prefix_cache()
    engine_, kv, worker = llm.engine, llm.engine.scheduler.kv, llm.engine.executor.worker
    allotted: list[set[int]] = []  # per call, as it was scheduled
    told: list[tuple[int, set[int], set[int]]] = []  # (call, blocks told, blocks loaded)
    execute, before_step = engine_.executor.execute, worker.offloader.before_step

    def recording(step):
        allotted.append(set().union(*(kv.block_ids(item.request_id)
                                      for item in step.scheduled)))
        return execute(step)

    def telling(transfers, touched, written, busy=None):
        if transfers is not None and transfers.loads:
            loaded = {b for load in transfers.loads for b in load.block_ids}
            told.append((len(allotted) - 1, busy(), loaded))
        return before_step(transfers, touched, written, busy)

    engine_.executor.execute, worker.offloader.before_step = recording, telling
    fresh = [(7 * i) % 990 + 3 for i in range(21)]  # in no tier
    decoding = engine_.add_request(fresh, SamplingParams(temperature=0.0, max_tokens=12))
    outputs = {}
    for _ in range(4):  # its prefill, then decodes, the last one still in flight
        outputs |= {o.request_id: o.token_ids for o in engine_.step(only_finished=True)}
    hit = engine_.add_request(PROMPTS[0], GREEDY)
    while engine_.has_unfinished():
        outputs |= {o.request_id: o.token_ids for o in engine_.step(only_finished=True)}
    assert outputs[hit] == expected[0]
    assert len(outputs[decoding]) == 12
    # one load, the hit's, in the step that runs it; told the decoding sequence's blocks as
    # the step before had them (six: its 21 prompt tokens and those decoded so far, in blocks
    # of 4), none of which it loads into
    [(call, blocks, loaded)] = told
    assert blocks == allotted[call - 1] and len(blocks) == 6
    assert len(loaded) == (len(PROMPTS[0]) - 1) // BS and blocks.isdisjoint(loaded)


def test_without_a_host_tier_the_same_run_recomputes(model, expected):
    llm = engine(model)
    assert generate(llm) == expected
    llm.engine.scheduler.kv.reset_prefix_cache()
    before = hits(llm)
    assert generate(llm) == expected
    assert hits(llm)[0] - before[0] < FINDABLE and hits(llm)[1:] == (0, 0)


def test_blocks_leaving_a_small_host_tier_are_served_from_disk(model, expected, tmp_path):
    llm = engine(model, host_kv_cache_gb=gib(16), disk_kv_cache_dir=str(tmp_path))
    assert generate(llm) == expected
    llm.engine.scheduler.kv.reset_prefix_cache()
    before = hits(llm)
    # newest first: the last prompts are still in the host tier, the first ones only on disk
    assert generate(llm, reverse=True) == expected
    after = hits(llm)
    found, host, disk = (a - b for a, b in zip(after, before, strict=True))
    assert found == host + disk == FINDABLE and host > 0 and disk > 0
    snapshot = llm.engine.metrics_snapshot()
    assert snapshot.kv_loaded_bytes["disk"] == llm.engine.scheduler.kv.tiers.counters \
        .read_from_disk * BLOCK_BYTES > 0


def test_a_second_engine_serves_the_first_one_s_prefixes_from_disk_and_refuses_bad_files(
        model, expected, tmp_path, caplog):
    first = engine(model, host_kv_cache_gb=gib(16), disk_kv_cache_dir=str(tmp_path))
    assert generate(first) == expected
    first.engine.executor.worker.offloader.flush()  # its files are written off the step
    disk = first.engine.scheduler.kv.tiers.disk
    on_disk = set(disk.index.entries)
    keys = first.engine.kv_hash_keys[1]
    # two of the files are damaged: one torn (truncated), one with a flipped byte
    first_blocks = [hash_full_blocks(p, BS, keys)[0] for p in PROMPTS]
    damaged = [h for h in first_blocks if h in on_disk][:2]
    assert len(damaged) == 2
    bad_files = []
    for block_hash, damage in zip(damaged, ("torn", "flipped"), strict=True):
        path = disk.directory / block_file_name(block_hash, 0, 1)
        data = path.read_bytes()
        path.write_bytes(data[:-100] if damage == "torn" else data[:-1] + bytes([data[-1] ^ 1]))
        bad_files.append((path, path.read_bytes()))
    usable = on_disk - set(damaged)

    def findable(prompt):
        count = 0
        for block_hash in hash_full_blocks(prompt, BS, keys)[: (len(prompt) - 1) // BS]:
            if block_hash not in usable:
                break
            count += BS
        return count

    second = engine(model, host_kv_cache_gb=gib(16), disk_kv_cache_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="workers.disk_io"):
        assert generate(second) == expected
    assert hits(second) == (sum(findable(p) for p in PROMPTS), 0,
                            sum(findable(p) for p in PROMPTS))
    assert sum(findable(p) for p in PROMPTS) > 0
    refused = sorted(r.getMessage().split(" refused (")[1].split(")")[0] for r in caplog.records)
    assert refused == ["data checksum mismatch", "truncated or overlong data"]
    # refused files were removed, for every process (one may be back, written anew from the
    # block the second engine recomputed)
    for path, bad in bad_files:
        assert not path.exists() or path.read_bytes() != bad


def test_a_disk_that_fails_mid_run_switches_its_tier_off_once_and_serving_goes_on(
        model, expected, tmp_path, caplog):
    llm = engine(model, host_kv_cache_gb=gib(8), disk_kv_cache_dir=str(tmp_path))
    disk = llm.engine.scheduler.kv.tiers.disk
    shutil.rmtree(disk.directory)
    disk.directory.write_text("")  # its directory is gone: every write fails
    with caplog.at_level(logging.WARNING, logger="kvstore.disk_tier"):
        assert generate(llm) == expected
    assert [r.getMessage() for r in caplog.records] == [
        f"the disk KV tier in {disk.directory} is off from now on: writing a block file failed "
        "(File exists); serving goes on without it"]
    assert not disk.enabled and hits(llm)[2] == 0


@pytest.mark.ray
def test_two_shards_keep_their_own_slots_and_files(ray_session, model, expected, tmp_path):
    # each shard's block is half the size: the same 16 slots in half the host memory per shard
    llm = engine(model, tensor_parallel_size=2, host_kv_cache_gb=gib(16),
                 disk_kv_cache_dir=str(tmp_path))
    try:
        assert llm.engine.scheduler.kv.tiers.host.num_slots == 16
        assert generate(llm) == expected
        llm.engine.scheduler.kv.reset_prefix_cache()
        before = hits(llm)
        assert generate(llm, reverse=True) == expected
        found, host, disk = (a - b for a, b in zip(hits(llm), before, strict=True))
        assert found == host + disk == FINDABLE and host > 0 and disk > 0
        tier = llm.engine.scheduler.kv.tiers.disk
        names = {p.name for p in tier.directory.iterdir()}
        assert names == {block_file_name(h, rank, 2) for h in tier.index.entries
                         for rank in range(2)}
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(("options", "message"), [
    ({"host_kv_cache_gb": -1.0}, "host_kv_cache_gb must be >= 0 (0: off), got -1.0"),
    ({"host_kv_cache_gb": 1.0, "disk_kv_cache_dir": "/tmp/x", "disk_kv_cache_gb": -2.0},
     "disk_kv_cache_gb must be > 0, got -2.0"),
    ({"disk_kv_cache_dir": "/tmp/x"},
     "disk_kv_cache_dir needs host_kv_cache_gb > 0: blocks reach the disk tier through the host "
     "tier"),
    ({"host_kv_cache_gb": 1.0, "enable_prefix_caching": False},
     "host_kv_cache_gb needs enable_prefix_caching: the tiers find blocks by their prefix "
     "hashes"),
    ({"host_kv_cache_gb": 1e-9}, "host_kv_cache_gb holds no KV block: one takes 2048 bytes a "
     "shard"),
])
def test_bad_tier_options_are_refused_with_the_reason(model, options, message):
    with pytest.raises(ValueError) as error:
        engine(model, **options)
    assert str(error.value) == message


def test_an_unwritable_disk_directory_is_refused_before_the_model_loads(model, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError) as error:
        engine(model, host_kv_cache_gb=gib(8), disk_kv_cache_dir=str(blocker / "kv"))
    assert str(error.value) == (f"disk_kv_cache_dir '{blocker / 'kv'}' is not a writable "
                                "directory (Not a directory)")


def test_int8_blocks_and_their_scales_come_back_from_host_and_disk(model, tmp_path):
    """A quantized cache's blocks travel with their scales: served from the tiers, the tokens
    are those the int8 cache gives when it recomputes."""
    recomputed = generate(engine(model, kv_cache_dtype="int8"))
    llm = engine(model, kv_cache_dtype="int8", host_kv_cache_gb=gib(8),
                 disk_kv_cache_dir=str(tmp_path))
    assert generate(llm) == recomputed
    llm.engine.scheduler.kv.reset_prefix_cache()
    before = hits(llm)
    assert generate(llm, reverse=True) == recomputed  # the latest first: still in host memory
    after = hits(llm)
    assert after[1] > before[1] and after[2] > before[2]  # from the host tier and from disk
    assert after[0] - before[0] == FINDABLE



class TimerStandIn:
    """The GPU's step timer on the CPU: a prefill step costs a millisecond and
    ``seconds_a_block`` for each block it loaded."""

    def __init__(self, seconds_a_block: float) -> None:
        self.seconds_a_block = seconds_a_block
        self.costs: list[StepCost] = []

    def start(self, step) -> None:
        if prompt_tokens(step) or loaded_blocks(step):
            self.costs.append(StepCost(prompt_tokens(step), prompt_tokens(step),
                                       loaded_blocks(step),
                                       1e-3 + self.seconds_a_block * loaded_blocks(step)))

    def stop(self) -> None:
        pass

    def take(self) -> list[StepCost]:
        costs, self.costs = self.costs, []
        return costs


def test_loads_whose_steps_cost_more_than_recomputing_turn_into_recomputes(model, expected):
    llm = engine(model, host_kv_cache_gb=gib(100))
    generate(llm)
    llm.engine.scheduler.kv.reset_prefix_cache()
    # a second a loaded block: the first load's step (4 blocks in 4 s, ~2.5 KB/s with the
    # prior) teaches the engine that loads don't pay; the other seven prompts recompute
    llm.engine.executor.worker.step_timer = TimerStandIn(1.0)
    before = hits(llm)
    assert generate(llm) == expected
    after = hits(llm)
    first_load = (len(PROMPTS[0]) - 1) // BS * BS
    assert (after[0] - before[0], after[1] - before[1]) == (first_load, first_load)
    rates = llm.engine.scheduler.rates
    assert rates is not None and rates.current().load_bytes_per_s < 1e5
    # nor is a new block written through now (but for one request in 16)
    assert llm.engine.scheduler.kv.tiers.write_through is False
