"""The KV directory: built from the replicas' event batches alone (device cache and host tier),
resynced from dumps."""

import pytest

from kvstore.block_hash import hash_full_blocks
from kvstore.directory import CacheDump, EventBatch, KVDirectory
from kvstore.events import HOST, BlockRemoved, BlockStored

A, B, C, D = (bytes([i]) * 32 for i in range(1, 5))


def stored(*hashes):
    return tuple(BlockStored(h, None) for h in hashes)


def in_host(*hashes):
    return tuple(BlockStored(h, None, HOST) for h in hashes)


def left_host(*hashes):
    return tuple(BlockRemoved(h, HOST) for h in hashes)


def test_batches_in_order_build_both_indexes():
    d = KVDirectory(2)
    assert d.apply(EventBatch(0, "e0", 0, stored(A, B))) is False
    assert d.apply(EventBatch(1, "e1", 0, stored(A))) is False
    assert d.apply(EventBatch(0, "e0", 1, (BlockRemoved(B), *stored(C)))) is False
    assert d.holders == {A: {0, 1}, C: {0}}
    assert (d.held_by(0), d.held_by(1), d.num_blocks) == ({A, C}, {A}, 2)
    d.check_integrity()


def test_longest_prefix_counts_leading_blocks_only():
    d = KVDirectory(3)
    d.apply(EventBatch(0, "e", 0, stored(A, B, C)))
    d.apply(EventBatch(1, "e", 0, stored(A, C)))  # holds C but not B: its prefix stops at A
    assert d.longest_prefixes([A, B, C, D], [0, 1, 2]) == {0: 3, 1: 1, 2: 0}
    assert d.longest_prefixes([B, C], [0, 1]) == {0: 2, 1: 0}
    assert d.longest_prefixes([], [0]) == {0: 0}


def test_a_removed_block_no_longer_attracts():
    d = KVDirectory(1)
    d.apply(EventBatch(0, "e", 0, stored(A, B)))
    d.apply(EventBatch(0, "e", 1, (BlockRemoved(A),)))
    assert d.longest_prefixes([A, B], [0]) == {0: 0}
    assert d.holders == {B: {0}}
    d.check_integrity()


def test_a_gap_asks_for_a_dump_and_the_resync_equals_a_fresh_build():
    d = KVDirectory(1)
    d.apply(EventBatch(0, "e", 0, stored(A)))
    # batch 1 is lost; 2 arrives: the directory asks for a dump and holds on to batch 2
    assert d.apply(EventBatch(0, "e", 2, (BlockRemoved(A), *stored(D)))) is True
    assert d.apply(EventBatch(0, "e", 3, stored(C))) is False  # kept while resyncing
    # the dump covers batches up to 1 (A, B held): 2 and 3 are replayed over it
    assert d.resync(CacheDump(0, "e", 1, (A, B))) is False
    fresh = KVDirectory(1)
    fresh.apply(EventBatch(0, "e", 0, stored(B, D, C)))
    assert d.holders == fresh.holders == {B: {0}, C: {0}, D: {0}}
    assert d.replicas[0].next_seq == 4
    d.check_integrity()


def test_a_dump_newer_than_the_waiting_batches_skips_them():
    d = KVDirectory(1)
    d.apply(EventBatch(0, "e", 0, stored(A)))
    assert d.apply(EventBatch(0, "e", 2, stored(B))) is True
    assert d.resync(CacheDump(0, "e", 5, (C,))) is False  # batch 2 is inside the dump
    assert d.holders == {C: {0}} and d.replicas[0].next_seq == 6
    assert d.apply(EventBatch(0, "e", 6, stored(D))) is False
    assert d.held_by(0) == {C, D}


def test_a_restarted_engine_starts_empty_and_a_late_first_batch_resyncs():
    d = KVDirectory(2)
    d.apply(EventBatch(0, "old", 0, stored(A, B)))
    d.apply(EventBatch(1, "x", 0, stored(A)))
    assert d.apply(EventBatch(0, "new", 0, stored(C))) is False
    assert d.holders == {A: {1}, C: {0}}
    # a new epoch whose first batch went missing: nothing of the old epoch survives either
    assert d.apply(EventBatch(1, "y", 1, stored(D))) is True
    assert d.holders == {C: {0}}
    assert d.resync(CacheDump(1, "y", 0, (B,))) is False
    assert d.holders == {B: {1}, C: {0}, D: {1}}
    d.check_integrity()


def test_a_dead_replica_drops_out_at_once():
    d = KVDirectory(2)
    d.apply(EventBatch(0, "e", 0, stored(A)))
    d.apply(EventBatch(1, "e", 0, stored(A, B)))
    d.remove_replica(1)
    assert d.holders == {A: {0}} and d.held_by(1) == set()
    assert d.longest_prefixes([A, B], [0, 1]) == {0: 1, 1: 0}
    # its next engine reports from batch 0 of a new epoch
    assert d.apply(EventBatch(1, "e2", 0, stored(B))) is False
    assert d.holders == {A: {0}, B: {1}}
    d.check_integrity()


def test_chained_hashes_of_real_prompts_match_by_prefix():
    d = KVDirectory(2)
    shared = list(range(64))
    first = hash_full_blocks(shared + [1] * 16, 16)
    d.apply(EventBatch(1, "e", 0, stored(*first)))
    other = hash_full_blocks(shared + [2] * 16, 16)  # same 4 leading blocks, another 5th
    assert d.longest_prefixes(other, [0, 1]) == {0: 0, 1: 4}


# -- the host tier ----------------------------------------------------------------------------

def test_a_block_evicted_from_the_device_but_kept_in_host_is_still_found_there():
    d = KVDirectory(2)
    d.apply(EventBatch(0, "e", 0, stored(A, B, C)))
    d.apply(EventBatch(0, "e", 1, in_host(A, B, C)))  # written through
    d.apply(EventBatch(0, "e", 2, (BlockRemoved(B), BlockRemoved(C))))  # the device's LRU
    found = d.matches([A, B, C, D], [0, 1])
    assert (found.device, found.listed, found.matched) == ({0: 1, 1: 0}, {0: 3, 1: 0},
                                                           {0: 3, 1: 0})
    assert found.num_host(0, 4) == 2 and found.num_host(0, 2) == 1
    assert (d.held_by(0), d.held_by(0, HOST), d.num_blocks) == ({A}, {A, B, C}, 3)
    assert d.holders == {A: {0}} and d.host_holders == {A: {0}, B: {0}, C: {0}}
    # evicted from the host tier too: gone, and the prefix stops before it
    d.apply(EventBatch(0, "e", 3, left_host(B)))
    assert d.longest_prefixes([A, B, C], [0]) == {0: 1}
    d.apply(EventBatch(0, "e", 4, left_host(A, C)))
    assert d.longest_prefixes([A, B, C], [0]) == {0: 1}  # A is on its device still
    d.apply(EventBatch(0, "e", 5, (BlockRemoved(A),)))
    assert d.longest_prefixes([A, B, C], [0]) == {0: 0} and d.num_blocks == 0
    assert d.holders == d.host_holders == {}
    d.check_integrity()


def test_past_its_device_hits_a_prefix_goes_on_in_the_host_tier_only():
    # replica 0: A, B on device (B in host too), C in host, D on device only: its engine
    # finds A, B on device, then C in host; D is not found (nothing after C is in host)
    d = KVDirectory(3)
    d.apply(EventBatch(0, "e", 0, (*stored(A, B, D), *in_host(B, C))))
    d.apply(EventBatch(1, "e", 0, in_host(A, B)))
    d.apply(EventBatch(2, "e", 0, stored(A)))
    expected = {"device": {0: 2, 1: 0, 2: 1}, "listed": {0: 3, 1: 2, 2: 1},
                "matched": {0: 4, 1: 2, 2: 1}}
    for replicas in ([0, 1, 2], [0], [1]):  # several replicas walked together, and one alone
        found = d.matches([A, B, C, D], replicas)
        for count, per_replica in expected.items():
            assert getattr(found, count) == {i: per_replica[i] for i in replicas}, count


def test_blocks_about_to_be_held_count_as_matched_only():
    d = KVDirectory(2)
    d.apply(EventBatch(0, "e", 0, (*stored(A), *in_host(B))))
    found = d.matches([A, B, C, D], [0, 1], {C: {0}, A: {1}})
    assert (found.device, found.listed, found.matched) == ({0: 1, 1: 0}, {0: 2, 1: 0},
                                                           {0: 3, 1: 1})


def test_host_runs_count_contiguous_host_blocks_from_a_first_one():
    d = KVDirectory(3)
    d.apply(EventBatch(0, "e", 0, (*stored(A, B, C, D), *in_host(A, C, D))))
    d.apply(EventBatch(1, "e", 0, in_host(B, C)))
    hashes = [A, B, C, D]
    assert d.host_runs(hashes, 0, 4, [0, 1, 2]) == {0: 1, 1: 0, 2: 0}
    assert d.host_runs(hashes, 1, 4, [0, 1, 2]) == {0: 0, 1: 2, 2: 0}
    assert d.host_runs(hashes, 2, 4, [0, 1]) == {0: 2, 1: 1}
    assert d.host_runs(hashes, 2, 3, [0, 1]) == {0: 1, 1: 1}  # no further than stop
    assert d.host_runs(hashes, 4, 9, [0]) == {0: 0}


def test_a_resync_restores_both_tiers_and_replays_host_events_after_the_dump():
    d = KVDirectory(1)
    d.apply(EventBatch(0, "e", 0, (*stored(A, B), *in_host(A, B))))
    # batch 1 is lost (B left the device); batch 2 says C entered the host tier and A left it
    assert d.apply(EventBatch(0, "e", 2, (*in_host(C), *left_host(A)))) is True
    assert d.resync(CacheDump(0, "e", 1, (A,), (A, B))) is False
    assert (d.held_by(0), d.held_by(0, HOST)) == ({A}, {B, C})
    fresh = KVDirectory(1)
    fresh.apply(EventBatch(0, "e", 0, (*stored(A), *in_host(B, C))))
    assert (d.holders, d.host_holders) == (fresh.holders, fresh.host_holders)
    assert d.replicas[0].next_seq == 3
    # a dump's events not yet taken come again in the next batch: replaying them changes
    # nothing (each tier is a set)
    assert d.apply(EventBatch(0, "e", 3, (*in_host(C), *left_host(A)))) is False
    assert d.held_by(0, HOST) == {B, C}
    d.check_integrity()


def test_a_new_epoch_or_a_dead_replica_forgets_its_host_tier_too():
    d = KVDirectory(2)
    d.apply(EventBatch(0, "old", 0, in_host(A, B)))
    d.apply(EventBatch(1, "e", 0, (*stored(A), *in_host(A))))
    assert d.apply(EventBatch(0, "new", 0, in_host(C))) is False
    assert d.host_holders == {A: {1}, C: {0}}
    d.remove_replica(1)
    assert d.holders == {} and d.host_holders == {C: {0}}
    # a gap in a new epoch drops the old host blocks before the dump comes
    assert d.apply(EventBatch(0, "newer", 1, in_host(D))) is True
    assert d.host_holders == {}
    assert d.resync(CacheDump(0, "newer", 0, (), (B,))) is False
    assert d.host_holders == {B: {0}, D: {0}}
    d.check_integrity()


def test_an_event_of_an_unknown_tier_is_refused():
    with pytest.raises(ValueError, match="unknown KV event tier 'disk'"):
        BlockStored(A, None, "disk")
    with pytest.raises(ValueError, match="unknown KV event tier 'gpu'"):
        BlockRemoved(A, "gpu")
    with pytest.raises(ValueError, match="unknown KV event tier"):
        KVDirectory(1).held_by(0, "disk")
