"""The steps of a pull, with a fake engine: an export pins the host tier's leading blocks until
the shards' copies are in the object store, and waits for blocks still on their way there;
a pull of another layout, or whose staging fails, is dropped (the request recomputes) and
what some shards staged is planned away."""

import asyncio
import logging
from types import SimpleNamespace

import pytest

from cluster.ray.kv_pull import ExportedBlocks, export_blocks, import_pull, stage_pull
from kvstore.block_hash import hash_full_blocks
from kvstore.host_tier import HostTier
from kvstore.tiers import TierManager
from kvstore.transfers import HostImport

pytestmark = pytest.mark.ray

BS = 4
PROMPT = list(range(100, 113))  # 3 full blocks
HASHES = hash_full_blocks(PROMPT, BS)
TOKENS = [PROMPT[i * BS:(i + 1) * BS] for i in range(3)]


class FakeShards:
    def __init__(self, ray, fail=False):
        self.ray, self.fail, self.exported, self.staged = ray, fail, [], []

    def export_host_slots(self, slots):
        self.exported.append(list(slots))
        return [self.ray.put(f"rank {rank}: slots {slots}") for rank in range(2)]

    def stage_host_import(self, import_id, shard_rows):
        async def stage(rows):
            if self.fail:
                raise RuntimeError("shard 1 died")
            self.staged.append((import_id, rows))
        return [stage(rows) for rows in shard_rows]


def fake_engine(ray, host_blocks=3, fail=False, layout="tag"):
    tiers = TierManager(HostTier(8), None, BS)
    for h, t in zip(HASHES[:host_blocks], TOKENS[:host_blocks], strict=True):
        tiers.host.allocate(h, t)
    kv = SimpleNamespace(tiers=tiers)
    return SimpleNamespace(scheduler=SimpleNamespace(kv=kv), executor=FakeShards(ray, fail),
                           offload_layout=layout)


async def now(call):  # the replica runs these between steps; here, at once
    return call()


def test_an_export_pins_the_leading_host_blocks_until_the_shards_have_copied_them(
        ray_session):
    engine = fake_engine(ray_session, host_blocks=2)
    tiers = engine.scheduler.kv.tiers
    pins = []

    async def between(call):  # what is pinned when each call runs
        pins.append(tiers.host.index.num_pinned)
        return call()

    exported = asyncio.run(export_blocks(engine, between, 0, HASHES, TOKENS))
    assert engine.executor.exported == [[0, 1]]  # the two it holds, a contiguous run
    assert pins == [0, 2]  # pinned from the first call until the last (the unpin)
    assert tiers.host.index.num_pinned == 0 and tiers.counters.exported == 2
    assert (exported.hashes, exported.token_ids) == (tuple(HASHES[:2]),
                                                     tuple(tuple(t) for t in TOKENS[:2]))
    assert [ray_session.get(ref) for ref in exported.shard_rows] == [
        "rank 0: slots [0, 1]", "rank 1: slots [0, 1]"]
    tiers.check_integrity()


def test_an_export_of_nothing_held_is_none_and_pins_nothing(ray_session):
    engine = fake_engine(ray_session, host_blocks=0)
    assert asyncio.run(export_blocks(engine, now, 0, HASHES, TOKENS)) is None
    assert engine.executor.exported == []
    engine.scheduler.kv.tiers.check_integrity()


def test_a_pull_lands_in_host_slots_planned_for_the_next_step(ray_session):
    source, target = fake_engine(ray_session), fake_engine(ray_session, host_blocks=0)
    exported = asyncio.run(export_blocks(source, now, 0, HASHES, TOKENS))
    import_id = asyncio.run(stage_pull(target, exported))
    assert [rows for _, rows in target.executor.staged] == list(exported.shard_rows)
    assert import_pull(target, import_id, exported) == 3
    tiers = target.scheduler.kv.tiers
    assert tiers.plan.imports == [HostImport(import_id, [0, 1, 2], [0, 1, 2])]
    assert [tiers.host.lookup(h, t).slot for h, t in zip(HASHES, TOKENS, strict=True)] == [
        0, 1, 2]
    tiers.check_integrity()


@pytest.mark.parametrize("case", ["layout", "staging"])
def test_a_pull_that_cannot_be_used_is_dropped_with_a_warning(ray_session, caplog, case):
    pull = ExportedBlocks(0, "tag", tuple(HASHES), tuple(tuple(t) for t in TOKENS),
                          (ray_session.put(b""), ray_session.put(b"")))
    target = fake_engine(ray_session, host_blocks=0, fail=case == "staging",
                         layout="other" if case == "layout" else "tag")
    with caplog.at_level(logging.WARNING, logger="cluster.ray.kv_pull"):
        assert asyncio.run(stage_pull(target, pull)) is None
    tiers = target.scheduler.kv.tiers
    if case == "layout":
        assert caplog.messages == ["pulled KV blocks of layout tag dropped: this replica's is "
                                   "other"]
        assert tiers.plan.imports == []
    else:
        assert caplog.messages == ["pulling 3 KV blocks from replica 0 failed "
                                   "(RuntimeError('shard 1 died')): they are recomputed"]
        assert [(i.rows, i.slots) for i in tiers.plan.imports] == [([], [])]
    assert len(tiers.host) == 0
