"""The scheduler with KV tiers below the device pool: write-through, demotion to disk, loads of
a prefix found there (from the host tier in the step that runs it; from disk while others
run), failed reads recomputed, aborts
mid-load and swap preemption; exact slots and blocks, then a fuzzed run against a simulated
worker that tracks which block's KV every device block, host slot and file holds."""

import random

import pytest

from kvstore.block_hash import hash_full_blocks
from kvstore.disk_tier import DiskTier
from kvstore.host_tier import HostTier
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.tiers import TierManager
from kvstore.transfers import BlockLoad, DiskRead, DiskWrite, KVTransfers, TransferReport
from router.sampling_params import SamplingParams
from router.scheduler import Scheduler, SchedulerConfig
from router.sequence import FinishReason, Sequence

BS = 4  # tokens per block


def make(tmp_path, num_blocks=16, host_slots=8, disk_blocks=0, budget=64, max_seqs=8):
    disk = DiskTier(tmp_path, "layout", disk_blocks) if disk_blocks else None
    tiers = TierManager(HostTier(host_slots), disk, BS)
    kv = KVCacheManager(num_blocks, BS, tiers=tiers)
    return Scheduler(SchedulerConfig(256, budget, max_seqs), kv)


def seq(request_id, prompt, max_tokens=1):
    return Sequence(request_id, list(prompt), SamplingParams(max_tokens=max_tokens))


def hashes(tokens):
    return hash_full_blocks(tokens, BS)


def step(sched, report=None, token=7):
    """One engine step: schedule, take the copies, then (as the engine does after the workers
    ran) apply their report and commit a token for every sequence caught up. Returns what ran
    — (request id, tokens computed before, new tokens) — and the copies."""
    output = sched.schedule()
    transfers = sched.kv.take_transfers()
    ran = [(s.seq.request_id, s.seq.num_computed_tokens, s.num_new_tokens)
           for s in output.scheduled]
    if report is not None:
        sched.apply_transfers(report)
    sampled = {s.seq.request_id: [token] for s in output.scheduled
               if s.seq.num_computed_tokens + s.num_new_tokens == s.seq.num_tokens}
    sched.update(output, sampled)
    sched.kv.check_integrity()
    return ran, transfers


def run_alone(sched, request_id, prompt):
    sched.add(seq(request_id, prompt))
    ran, transfers = step(sched)
    assert ran == [(request_id, 0, len(prompt))]
    assert not sched.has_unfinished()
    return transfers


PROMPT = list(range(100, 113))  # 13 tokens: 3 full blocks and one token


def test_blocks_entering_the_prefix_cache_are_written_through_after_the_next_forward(tmp_path):
    sched = make(tmp_path)
    assert run_alone(sched, "a", PROMPT) is None  # cached at the end of the step
    _, transfers = step(sched)  # the next step message carries their copies
    assert transfers == KVTransfers(stores=[(0, 0), (1, 1), (2, 2)])
    host = sched.kv.tiers.host
    assert [host.lookup(h, PROMPT[i * BS:(i + 1) * BS]).slot
            for i, h in enumerate(hashes(PROMPT))] == [0, 1, 2]
    assert step(sched)[1] is None  # once per block


def test_a_block_handed_out_again_before_its_copy_is_copied_before_the_forward(tmp_path):
    sched = make(tmp_path, num_blocks=4)
    run_alone(sched, "a", PROMPT)  # blocks 0-3; 0-2 cached and evictable, 3 free
    sched.add(seq("b", range(500, 513)))  # needs 4 blocks: 3, then 2, 1, 0 evicted (LRU tail)
    output = sched.schedule()
    assert output.scheduled[0].new_block_ids == [3, 2, 1, 0]
    transfers = sched.kv.take_transfers()
    assert transfers == KVTransfers(stores_first=[(0, 0), (1, 1), (2, 2)])


def test_a_prefix_evicted_from_the_device_is_loaded_from_the_host_in_the_step_that_runs_it(
        tmp_path):
    sched = make(tmp_path, num_blocks=8)
    run_alone(sched, "a", PROMPT)
    step(sched)  # a's three blocks reach host slots 0-2
    sched.kv.reset_prefix_cache()  # the device forgets them
    sched.add(seq("b", PROMPT + [5, 6], max_tokens=4))  # 15 tokens: blocks 0-2 below the pool
    sched.add(seq("c", range(300, 303)))
    ran, transfers = step(sched)
    # b's prefix is loaded into fresh blocks (a's 4 blocks went to the free queue's back) by
    # the step that runs b's last 3 tokens (the forward waits for the copies); c runs too
    assert ran == [("b", 12, 3), ("c", 0, 3)]
    assert transfers.loads == [BlockLoad("b", [0, 1, 2], [4, 5, 6], in_step=True)]
    assert list(sched.loading) == [] and sched.loads.in_step == {"b"}
    assert sched.kv.tiers.host.index.num_pinned == 3  # until the workers report the copies
    stats = sched.kv.stats
    assert (stats.hits, stats.host_hits, stats.disk_hits) == (12, 12, 0)
    step(sched, TransferReport(loaded={"b": 3}))
    assert sched.loads.in_step == set() and sched.kv.tiers.host.index.num_pinned == 0


def test_a_sequence_that_ends_before_its_in_step_load_is_reported_unpins_its_blocks(tmp_path):
    sched = make(tmp_path, num_blocks=8)
    run_alone(sched, "a", PROMPT)
    step(sched)
    sched.kv.reset_prefix_cache()
    sched.add(seq("b", PROMPT + [5, 6]))
    step(sched)  # b ran and finished (one token) before the copies were reported
    assert sched.kv.tiers.host.index.num_pinned == 0 and sched.loads.in_step == {"b"}
    step(sched, TransferReport(loaded={"b": 3}))  # the late report changes nothing
    assert sched.loads.in_step == set() and sched.kv.tiers.host.index.num_pinned == 0
    sched.kv.check_integrity()


def test_blocks_leaving_the_host_tier_go_to_disk_and_come_back_through_a_host_slot(tmp_path):
    sched = make(tmp_path, num_blocks=8, host_slots=3, disk_blocks=8)
    run_alone(sched, "a", PROMPT)
    step(sched)  # a's blocks 0-2 in slots 0-2
    other = list(range(700, 705))  # one full block
    run_alone(sched, "c", other)
    (c_block,) = sched.kv.pool.cached[hashes(other)[0]].block_id,
    _, transfers = step(sched)
    h, q = hashes(PROMPT), hashes(other)[0]
    # no free slot: the least recently used block (a's first) goes to disk, then its slot is c's
    assert transfers == KVTransfers(to_disk=[DiskWrite(0, h[0], tuple(PROMPT[:4]))],
                                    stores=[(c_block, 0)])
    assert list(sched.kv.tiers.disk.index.lru) == [h[0]]
    sched.kv.reset_prefix_cache()
    sched.add(seq("b", PROMPT))
    _, transfers = step(sched)
    # block 0 is on disk, 1 and 2 in the host tier: block 0 needs a slot, and takes the least
    # recently used one that is not being loaded (c's, which goes to disk first)
    b_blocks = sched.kv.block_ids("b")
    assert transfers == KVTransfers(
        to_disk=[DiskWrite(0, q, tuple(other[:4]))],
        from_disk=[DiskRead(h[0], tuple(PROMPT[:4]), 0)],
        loads=[BlockLoad("b", [0, 1, 2], b_blocks[:3])])
    step(sched, TransferReport(loaded={"b": 3}))
    assert step(sched)[0] == [("b", 12, 1)]
    assert (sched.kv.stats.host_hits, sched.kv.stats.disk_hits) == (8, 4)


def test_a_refused_disk_read_is_recomputed_and_forgotten(tmp_path):
    sched = make(tmp_path, num_blocks=8, host_slots=2, disk_blocks=8)
    run_alone(sched, "a", PROMPT)
    step(sched)  # blocks 0 and 1 in the host tier (two slots: 2 waits for one)
    run_alone(sched, "c", range(700, 705))
    step(sched)  # block 2, then c's block, take the slots: blocks 0 and 1 go to disk
    h = hashes(PROMPT)
    assert set(sched.kv.tiers.host.hashes()) == {h[2], hashes(range(700, 705))[0]}
    sched.kv.reset_prefix_cache()
    sched.add(seq("b", PROMPT))
    _, transfers = step(sched)
    # block 0 is read into c's slot; block 1 finds none free (0's and 2's are pinned)
    assert [read.block_hash for read in transfers.from_disk] == [h[0]]
    assert transfers.loads[0].host_slots == [1]
    step(sched, TransferReport(loaded={"b": 0}, failed_reads=[h[0]]))
    assert h[0] not in sched.kv.tiers.host and h[0] not in sched.kv.tiers.disk
    # intact, but after the gap: not hits this time
    assert h[1] in sched.kv.tiers.disk and h[2] in sched.kv.tiers.host
    assert step(sched)[0] == [("b", 0, 13)]  # recomputed from the start
    assert (sched.kv.stats.hits, sched.kv.stats.host_hits, sched.kv.stats.disk_hits) == (0, 0, 0)


def test_an_aborted_sequence_s_load_unpins_its_blocks(tmp_path):
    sched = make(tmp_path, num_blocks=8)
    run_alone(sched, "a", PROMPT)
    step(sched)
    sched.kv.reset_prefix_cache()
    sched.add(seq("b", PROMPT, max_tokens=4))
    step(sched)
    assert sched.loads.in_step == {"b"}  # it ran on its load, not reported yet
    assert sched.finish("b", FinishReason.ABORT) is not None
    assert sched.kv.tiers.host.index.num_pinned == 0 and sched.kv.num_used_blocks == 0
    step(sched, TransferReport(loaded={"b": 3}))  # its late report is ignored
    assert not sched.has_unfinished()


def test_swap_out_copies_the_blocks_a_preempted_request_lost_from_the_host_tier(tmp_path):
    kv = KVCacheManager(16, BS, tiers=TierManager(HostTier(4), None, BS))

    def compute(request_id, tokens):
        kv.get_computed_blocks(request_id, tokens)
        kv.allocate_slots(request_id, 0, len(tokens))
        kv.cache_blocks(request_id, tokens, len(tokens))

    compute("a", PROMPT)  # blocks 0-2 full
    assert kv.take_transfers() == KVTransfers(stores=[(0, 0), (1, 1), (2, 2)])
    compute("c", range(700, 709))  # blocks 4-5 full: c's second takes a's first's slot
    assert kv.take_transfers() == KVTransfers(stores=[(4, 3), (5, 0)])
    kv.swap_out("a")  # preempted: its lost block is copied again, into the LRU slot (c's first)
    assert kv.take_transfers() == KVTransfers(stores=[(0, 3)])
    kv.swap_out("a")
    assert kv.take_transfers() is None  # all there now: nothing to copy
    kv.free("a")
    kv.free("c")
    kv.check_integrity()


# -- a fuzzed run against a simulated worker ------------------------------------------------

GARBAGE = b"garbage"  # a slot whose file was refused


class ShadowWorker:
    """Moves block labels (the hash of the KV a place holds) the way a worker moves KV, in the
    order of kvstore/transfers.py, and checks that every copy and every forward reads the
    block it should: the planner never loses or mixes up a block, whatever the timing."""

    def __init__(self, sched, rng, fail_reads, max_delay):
        self.sched, self.kv, self.rng = sched, sched.kv, rng
        self.fail_reads, self.max_delay = fail_reads, max_delay
        self.device: dict[int, bytes | None] = {}  # block id -> the block hash its KV is
        self.host: dict[int, bytes | None] = {}  # slot -> block hash
        self.disk: dict[bytes, bytes] = {}  # file -> the block hash it holds
        self.reports: list[tuple[int, str, int]] = []  # (steps left, request id, blocks ok)
        self.failed: list[bytes] = []

    def slot_of(self, slot):
        """The hash the host tier thinks the slot holds (after the plan was taken)."""
        return next(h for h, e in self.kv.tiers.host.index.entries.items() if e.value.slot == slot)

    def run(self, output, transfers):
        plan = transfers or KVTransfers()
        for write in plan.to_disk:  # the slot still holds the block leaving it
            assert self.host.get(write.slot) == write.block_hash
            self.disk[write.block_hash] = write.block_hash
        self._stores(plan.stores_first)
        failed_slots = set()
        for read in plan.from_disk:
            ok = self.disk.get(read.block_hash) == read.block_hash
            if ok and self.rng.random() < self.fail_reads:
                ok = False  # a torn or corrupt file
            self.host[read.slot] = read.block_hash if ok else GARBAGE
            if not ok:
                failed_slots.add(read.slot)
                self.failed.append(read.block_hash)
        for load in plan.loads:
            hashes = self.kv.req_hashes[load.request_id]
            first = self.kv.req_load_first[load.request_id]
            assert load.block_ids == self.kv.block_ids(load.request_id)[first:first + len(
                load.block_ids)]
            num_ok = next((i for i, s in enumerate(load.host_slots) if s in failed_slots),
                          len(load.host_slots))
            for i, (slot, block) in enumerate(zip(load.host_slots[:num_ok], load.block_ids,
                                                  strict=False)):
                assert self.host[slot] == hashes[first + i]
                self.device[block] = self.host[slot]
            self.reports.append((self.rng.randint(0, self.max_delay), load.request_id, num_ok))
        self._forward(output)
        self._stores(plan.stores)
        due = [r for r in self.reports if r[0] == 0]
        self.reports = [(d - 1, rid, n) for d, rid, n in self.reports if d > 0]
        report = TransferReport({rid: n for _, rid, n in due}, self.failed)
        self.failed = []
        return report

    def _stores(self, pairs):
        for block, slot in pairs:
            assert self.device.get(block) == self.slot_of(slot)  # the KV meant for that slot
            self.host[slot] = self.device[block]

    def _forward(self, output):
        for item in output.scheduled:
            seq = item.seq
            blocks = self.kv.block_ids(seq.request_id)
            hashes = hash_full_blocks(seq.token_ids, BS)
            start = seq.num_computed_tokens
            for i in range(start // BS):  # what attention reads: the blocks before
                assert self.device.get(blocks[i]) == hashes[i], (seq.request_id, i)
            end = start + item.num_new_tokens
            for i in range(start // BS, -(-end // BS)):
                self.device[blocks[i]] = hashes[i] if (i + 1) * BS <= end else None


def sampled_token(seq):
    return 100 + (sum(seq.token_ids) * 31 + seq.num_tokens) % 50  # a function of the prefix


@pytest.mark.parametrize("seed", range(6))
def test_a_fuzzed_run_never_reads_a_wrong_block_and_keeps_every_tier_conserved(tmp_path, seed):
    rng = random.Random(seed)
    sched = make(tmp_path / str(seed), num_blocks=12, host_slots=6, disk_blocks=10, budget=24,
                 max_seqs=4)
    worker = ShadowWorker(sched, rng, fail_reads=0.15, max_delay=2 if seed % 2 else 0)
    prefixes = [[rng.randrange(1000) for _ in range(12)] for _ in range(3)]
    live: set[str] = set()
    for number in range(300):
        if rng.random() < 0.4:
            request_id = f"r{number}"
            tail = [rng.randrange(1000) for _ in range(rng.randint(1, 6))]
            sched.add(seq(request_id, rng.choice(prefixes) + tail, max_tokens=rng.randint(1, 12)))
            live.add(request_id)
        if live and rng.random() < 0.05:
            victim = rng.choice(sorted(live))
            sched.finish(victim, FinishReason.ABORT)
            live.discard(victim)
        if rng.random() < 0.05:
            sched.kv.reset_prefix_cache()  # the device forgets: the tiers are all that is left
        output = sched.schedule()
        report = worker.run(output, sched.kv.take_transfers())
        sched.apply_transfers(report)
        sampled = {s.seq.request_id: [sampled_token(s.seq)] for s in output.scheduled
                   if s.seq.num_computed_tokens + s.num_new_tokens == s.seq.num_tokens}
        for finished in sched.update(output, sampled):
            live.discard(finished.request_id)
        sched.kv.check_integrity()
    stats = sched.kv.stats
    assert stats.host_hits > 0 and stats.disk_hits > 0 and sched.num_preemptions > 0
