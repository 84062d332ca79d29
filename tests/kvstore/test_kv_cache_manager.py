import pytest

from kvstore.block_hash import hash_full_blocks
from kvstore.events import HOST, BlockRemoved, BlockStored
from kvstore.host_tier import HostTier
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.tiers import TierManager


def ids(blocks):
    return [block.block_id for block in blocks]


def run_prefill(kv, request_id, tokens):
    """Schedule a whole prompt, as the scheduler would, then cache what was computed."""
    hits, num_cached = kv.get_computed_blocks(request_id, tokens)
    new = kv.allocate_slots(request_id, num_cached, len(tokens) - num_cached, hits)
    assert new is not None
    kv.stats.record(len(tokens), num_cached)
    kv.cache_blocks(request_id, tokens, len(tokens))
    return hits, new


def test_allocate_counts_blocks_and_free_returns_them_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert ids(kv.allocate_slots("a", 0, 10)) == [0, 1, 2]
    assert ids(kv.allocate_slots("b", 0, 4)) == [3]
    assert ids(kv.allocate_slots("a", 10, 2)) == []  # 12 tokens still fit in 3 blocks
    assert ids(kv.allocate_slots("a", 12, 1)) == [4]
    kv.free("a")
    # the free queue now ends with a's blocks, tail first
    assert list(kv.pool.free_queue) == [5, 6, 7, 4, 2, 1, 0]
    assert kv.num_used_blocks == 1
    kv.check_integrity()


def test_allocation_failure_returns_none_and_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert ids(kv.allocate_slots("a", 0, 12)) == [0, 1, 2]
    assert kv.allocate_slots("b", 0, 8) is None
    assert kv.block_ids("b") == [] and kv.num_free_blocks == 1
    assert kv.allocate_slots("a", 12, 1, num_lookahead_tokens=4) is None
    assert kv.block_ids("a") == [0, 1, 2]
    kv.check_integrity()


def test_prefix_hit_shares_blocks_and_counts_references():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    run_prefill(kv, "a", prompt)
    assert kv.block_ids("a") == [0, 1, 2]
    hits, new = run_prefill(kv, "b", prompt[:8] + [7, 7, 7])
    assert ids(hits) == [0, 1] and ids(new) == [3]
    assert [kv.pool.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    assert kv.stats.queries == 21 and kv.stats.hits == 8
    kv.check_integrity()


def test_whole_prompt_hit_still_computes_the_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    run_prefill(kv, "a", list(range(8)))
    hits, num_cached = kv.get_computed_blocks("b", list(range(8)))
    assert ids(hits) == [0] and num_cached == 4


def test_freed_cached_blocks_are_reused_then_evicted_lru_tail_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    run_prefill(kv, "a", [1, 2, 3, 4, 5])  # blocks 0, 1 cached; 2 holds the partial block
    kv.free("a")
    assert list(kv.pool.free_queue) == [3, 2, 1, 0]
    kv.take_events()
    # a hit on evictable blocks takes them back out of the free queue
    hits, new = run_prefill(kv, "b", [1, 2, 3, 4, 9])
    assert ids(hits) == [0, 1] and ids(new) == [3]
    kv.free("b")
    assert list(kv.pool.free_queue) == [2, 3, 1, 0]
    # new work evicts from the front: the partial block, then b's tail, then the prefix tail
    run_prefill(kv, "c", [50, 51, 52, 53, 54, 55])
    assert kv.block_ids("c") == [2, 3, 1]
    a_hashes = hash_full_blocks([1, 2, 3, 4], 2)
    c_hashes = hash_full_blocks([50, 51, 52, 53, 54, 55], 2)
    assert kv.take_events() == [
        BlockRemoved(a_hashes[1]),
        BlockStored(c_hashes[0], None),
        BlockStored(c_hashes[1], c_hashes[0]),
        BlockStored(c_hashes[2], c_hashes[1]),
    ]
    assert kv.pool.lookup(a_hashes[0], [1, 2]) is kv.pool.blocks[0]
    kv.check_integrity()


def test_hit_is_verified_against_token_ids():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    run_prefill(kv, "a", [1, 2, 3])
    block_hash = kv.pool.blocks[0].block_hash
    kv.pool.blocks[0].token_ids = (9, 9)  # as if another prefix collided on the hash
    assert kv.pool.lookup(block_hash, [1, 2]) is None
    assert kv.get_computed_blocks("b", [1, 2, 3]) == ([], 0)


def test_cache_salt_and_disabled_caching_isolate_requests():
    kv = KVCacheManager(num_blocks=8, block_size=2)
    run_prefill(kv, "a", [1, 2, 3])
    assert kv.get_computed_blocks("b", [1, 2, 3], cache_salt="tenant-2")[1] == 0
    off = KVCacheManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    run_prefill(off, "a", [1, 2, 3])
    assert off.get_computed_blocks("b", [1, 2, 3]) == ([], 0)
    assert off.pool.num_cached_blocks == 0


def test_hit_on_evictable_blocks_needs_room_for_them_too():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    run_prefill(kv, "a", [1, 2, 3, 4, 5])
    kv.free("a")
    hits, num_cached = kv.get_computed_blocks("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert num_cached == 4
    # 2 evictable hits + 3 new blocks > 3 free blocks
    assert kv.allocate_slots("b", num_cached, 5, hits) is None
    assert [b.ref_count for b in kv.pool.blocks] == [0, 0, 0]
    kv.check_integrity()


def test_double_free_of_a_block_is_an_error():
    kv = KVCacheManager(num_blocks=2, block_size=2)
    kv.allocate_slots("a", 0, 2)
    block = kv.req_blocks["a"][0]
    kv.free("a")
    with pytest.raises(RuntimeError, match="block 0 freed more often than taken"):
        kv.pool.free([block])


def test_the_host_tier_s_entries_and_evictions_are_events_of_their_tier():
    kv = KVCacheManager(num_blocks=4, block_size=2, tiers=TierManager(HostTier(3), None, 2))
    run_prefill(kv, "a", [1, 2, 3, 4, 5])
    a = hash_full_blocks([1, 2, 3, 4], 2)
    # cached on the device; written through by the next step message
    assert kv.take_events() == [BlockStored(a[0], None), BlockStored(a[1], a[0])]
    assert kv.take_transfers().stores == [(0, 0), (1, 1)]
    assert kv.take_events() == [BlockStored(a[0], None, HOST), BlockStored(a[1], None, HOST)]
    kv.free("a")
    # c's three blocks evict a's second from the device (its first stays there), and from
    # the 3-slot host tier a's first (its least recently used), then its second
    run_prefill(kv, "c", [50, 51, 52, 53, 54, 55])
    c = hash_full_blocks([50, 51, 52, 53, 54, 55], 2)
    assert kv.take_transfers().stores == [(3, 2), (2, 0), (1, 1)]
    assert kv.take_events() == [
        BlockRemoved(a[1]), BlockStored(c[0], None), BlockStored(c[1], c[0]),
        BlockStored(c[2], c[1]),
        BlockStored(c[0], None, HOST), BlockRemoved(a[0], HOST), BlockStored(c[1], None, HOST),
        BlockRemoved(a[1], HOST), BlockStored(c[2], None, HOST),
    ]
    assert kv.cached_hashes() == (a[0], *c) and kv.host_hashes() == tuple(c)
    kv.tiers.host.discard(c[1])  # its slot can't be trusted (a read failed)
    assert kv.take_events() == [BlockRemoved(c[1], HOST)]
    kv.check_integrity()


def test_without_a_host_tier_only_device_events_come():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    run_prefill(kv, "a", [1, 2, 3])
    assert kv.take_events() == [BlockStored(hash_full_blocks([1, 2], 2)[0], None)]
    assert kv.host_hashes() == ()
