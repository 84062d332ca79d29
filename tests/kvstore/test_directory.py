"""The KV directory: built from the replicas' event batches alone, resynced from dumps."""

from kvstore.block_hash import hash_full_blocks
from kvstore.directory import CacheDump, EventBatch, KVDirectory
from kvstore.events import BlockRemoved, BlockStored

A, B, C, D = (bytes([i]) * 32 for i in range(1, 5))


def stored(*hashes):
    return tuple(BlockStored(h, None) for h in hashes)


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
