"""The host and disk tiers' bookkeeping, and the block file format: exact slots, files and
reasons; conservation after every scenario."""

import logging
import os
import time

import pytest

from kvstore.block_file import block_file_name, read_block_file, write_block_file
from kvstore.block_hash import hash_block_tokens
from kvstore.disk_tier import DiskTier
from kvstore.host_tier import HostBlock, HostTier
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.tier_index import TierIndex
from kvstore.tiers import TierManager

LAYOUT = "0123456789abcdef"


def h(n: int) -> bytes:
    return hash_block_tokens(None, [n])


def write_block(directory, block_hash, rank=0, tp_size=1, data=b"\x01" * 64, tokens=(1,)):
    directory.mkdir(parents=True, exist_ok=True)
    write_block_file(directory / block_file_name(block_hash, rank, tp_size), block_hash, LAYOUT,
                     tokens, memoryview(data))


# -- the LRU index with pins --------------------------------------------------------------

def test_the_index_evicts_least_recently_used_first_and_never_a_pinned_entry():
    index: TierIndex[int] = TierIndex(3)
    for n in range(3):
        index.add(h(n), n)
    index.touch(h(0))  # order now 1, 2, 0
    index.pin(h(1))
    assert index.pop_lru() == (h(2), 2)
    assert index.pop_lru() == (h(0), 0)
    assert index.pop_lru() is None  # only the pinned one is left
    index.unpin(h(1))
    assert index.pop_lru() == (h(1), 1)
    index.add(h(5), 5)
    with pytest.raises(RuntimeError, match="unpinned more often than pinned"):
        index.unpin(h(5))
    index.check_integrity()


# -- the host tier ------------------------------------------------------------------------

def test_host_slots_are_taken_in_order_then_reused_from_the_least_recently_used():
    host = HostTier(num_slots=2)
    assert host.allocate(h(0), [0]) == (0, None)
    assert host.allocate(h(1), [1]) == (1, None)
    host.touch(h(0))
    slot, evicted = host.allocate(h(2), [2])
    assert slot == 1 and evicted is not None and evicted[0] == h(1)  # h(1) leaves, slot reused
    assert evicted[1].token_ids == (1,)
    assert host.lookup(h(2), [2]).slot == 1 and host.lookup(h(0), [0]).slot == 0
    host.check_integrity()


def test_a_host_hit_is_verified_against_its_tokens():
    host = HostTier(num_slots=1)
    host.allocate(h(0), [7, 8])
    assert host.lookup(h(0), [7, 9]) is None
    assert host.lookup(h(0), [7, 8]).slot == 0


def test_pinned_host_blocks_are_not_evicted_and_a_full_pinned_tier_refuses():
    host = HostTier(num_slots=2)
    host.allocate(h(0), [0], pinned=True)
    host.allocate(h(1), [1])
    host.pin(h(1))
    assert host.allocate(h(2), [2]) is None
    host.unpin(h(1))
    assert host.allocate(h(2), [2]) == (1, (h(1), HostBlock(1, (1,))))
    host.discard(h(0))  # a failed read: its slot is free again
    assert 0 in host.free_slots and h(0) not in host
    host.check_integrity()


# -- block files --------------------------------------------------------------------------

def test_a_block_file_round_trips_and_is_refused_when_it_is_not_this_block(tmp_path):
    block_hash, data = h(1), bytes(range(64))
    write_block(tmp_path, block_hash, data=data, tokens=(5, 6))
    path = tmp_path / block_file_name(block_hash, 0, 1)
    into = bytearray(64)
    assert read_block_file(path, block_hash, LAYOUT, [5, 6], memoryview(into)) is None
    assert bytes(into) == data
    assert read_block_file(path, h(2), LAYOUT, [5, 6], memoryview(into)) == "another block's file"
    assert read_block_file(path, block_hash, "f" * 16, [5, 6],
                           memoryview(into)) == "another layout's file"
    assert read_block_file(path, block_hash, LAYOUT, [5, 7],
                           memoryview(into)) == "another prefix's tokens"
    assert read_block_file(path, block_hash, LAYOUT, [5, 6],
                           memoryview(bytearray(32))) == "64 data bytes, expected 32"
    assert read_block_file(tmp_path / "none.kv", block_hash, LAYOUT, [5, 6],
                           memoryview(into)) == "missing"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file is left


@pytest.mark.parametrize(("damage", "reason"), [
    (lambda b: b[:-1], "truncated or overlong data"),
    (lambda b: b + b"x", "truncated or overlong data"),
    (lambda b: b[:20], "truncated header"),
    (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "data checksum mismatch"),
    (lambda b: b[:70] + bytes([b[70] ^ 1]) + b[71:], "header checksum mismatch"),
    (lambda b: b"X" + b[1:], "not a block file"),
])
def test_a_torn_or_corrupt_block_file_is_refused_with_the_reason(tmp_path, damage, reason):
    block_hash = h(1)
    write_block(tmp_path, block_hash, data=bytes(range(64)), tokens=(5, 6))
    path = tmp_path / block_file_name(block_hash, 0, 1)
    path.write_bytes(damage(path.read_bytes()))
    assert read_block_file(path, block_hash, LAYOUT, [5, 6], memoryview(bytearray(64))) == reason


def test_a_failed_write_leaves_no_file_behind(tmp_path):
    target = tmp_path / "missing-dir" / "x.kv"
    with pytest.raises(OSError):
        write_block_file(target, h(1), LAYOUT, [1], memoryview(b"abc"))
    assert not (tmp_path / "missing-dir").exists()


# -- the disk tier ------------------------------------------------------------------------

def test_the_disk_index_is_rebuilt_from_the_directory_oldest_first(tmp_path):
    layout_dir = tmp_path / LAYOUT
    for n in range(3):
        write_block(layout_dir, h(n))
        os.utime(layout_dir / block_file_name(h(n), 0, 1), (1000 + n, 1000 + n))
    (layout_dir / "notes.txt").write_text("not a block")
    disk = DiskTier(tmp_path, LAYOUT, capacity=2)
    # three files, room for two: the oldest was evicted, its file removed
    assert list(disk.index.lru) == [h(1), h(2)]
    assert not (layout_dir / block_file_name(h(0), 0, 1)).exists()
    assert (layout_dir / "notes.txt").exists()
    disk.check_integrity()


def test_a_block_is_on_disk_only_with_every_shard_s_file(tmp_path):
    layout_dir = tmp_path / LAYOUT
    write_block(layout_dir, h(0), rank=0, tp_size=2)
    write_block(layout_dir, h(0), rank=1, tp_size=2)
    write_block(layout_dir, h(1), rank=0, tp_size=2)  # rank 1's file is missing
    write_block(layout_dir, h(2), rank=0, tp_size=1)  # another tensor-parallel size
    disk = DiskTier(tmp_path, LAYOUT, capacity=8, tp_size=2)
    assert list(disk.index.lru) == [h(0)]
    assert not disk.lookup(h(1)) and not disk.lookup(h(2))
    assert disk.paths(h(0)) == [layout_dir / f"{h(0).hex()}.tp2r0.kv",
                                layout_dir / f"{h(0).hex()}.tp2r1.kv"]


def test_blocks_another_process_writes_later_are_adopted_on_lookup(tmp_path):
    disk = DiskTier(tmp_path, LAYOUT, capacity=2)
    assert not disk.lookup(h(0))
    write_block(tmp_path / LAYOUT, h(0))  # another process, sharing the directory
    assert disk.lookup(h(0)) and h(0) in disk
    disk.check_integrity()


def test_disk_eviction_removes_the_least_recently_used_block_s_files(tmp_path):
    disk = DiskTier(tmp_path, LAYOUT, capacity=2)
    write_block(tmp_path / LAYOUT, h(0))  # another process's: adopted, not written here
    assert disk.lookup(h(0))
    assert disk.add(h(1))
    write_block(tmp_path / LAYOUT, h(1))
    assert not disk.add(h(1))  # already there: touched, nothing to write
    assert disk.add(h(2))  # evicts h(0), the least recently used: its file goes at once
    assert not (tmp_path / LAYOUT / block_file_name(h(0), 0, 1)).exists()
    assert set(disk.index.entries) == {h(1), h(2)} and disk.take_deletes() == []
    disk.pin(h(1))
    disk.pin(h(2))
    assert not disk.add(h(3))  # everything pinned: no room
    disk.unpin(h(1))
    disk.unpin(h(2))
    disk.discard(h(1))  # its read failed (after its write): its files go at once
    assert not (tmp_path / LAYOUT / block_file_name(h(1), 0, 1)).exists()
    assert disk.take_deletes() == []
    disk.check_integrity()


def test_a_block_evicted_while_its_write_may_be_queued_is_deleted_by_the_writers(tmp_path):
    disk = DiskTier(tmp_path, LAYOUT, capacity=2)
    for n in range(2):
        assert disk.add(h(n))  # the workers write them, off the step
    write_block(tmp_path / LAYOUT, h(0))
    disk.pin(h(1))
    assert disk.add(h(2))  # evicts h(0): its write may not have landed yet, so it is not
    assert (tmp_path / LAYOUT / block_file_name(h(0), 0, 1)).exists()  # removed here
    assert disk.take_deletes() == [h(0)] and disk.take_deletes() == []
    # evicted, then added again before the step message went: its delete is called off
    disk.unpin(h(1))  # the LRU order is now h(2), h(1)
    assert disk.add(h(3))  # evicts h(2)
    assert disk.add(h(2))  # evicts h(1); h(2)'s new write would come before its delete
    assert disk.take_deletes() == [h(1)]
    assert set(disk.index.entries) == {h(2), h(3)}
    disk.check_integrity()


def test_stale_temporary_files_of_dead_writers_are_removed_fresh_ones_kept(tmp_path):
    layout_dir = tmp_path / LAYOUT
    layout_dir.mkdir()
    stale, fresh = layout_dir / ".a.kv.1.tmp", layout_dir / ".b.kv.2.tmp"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    disk = DiskTier(tmp_path, LAYOUT, capacity=2)
    assert not stale.exists() and fresh.exists() and len(disk) == 0


def test_an_unusable_directory_is_a_clear_error(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(ValueError) as error:
        DiskTier(not_a_dir, LAYOUT, capacity=1)
    assert str(error.value) == (f"disk_kv_cache_dir '{not_a_dir}' is not a writable directory "
                                "(Not a directory)")


def test_a_disabled_disk_tier_finds_nothing_and_says_so_once(tmp_path, caplog):
    disk = DiskTier(tmp_path, LAYOUT, capacity=2)
    disk.add(h(0))
    write_block(tmp_path / LAYOUT, h(0))
    with caplog.at_level(logging.WARNING):
        disk.disable("No space left on device")
        disk.disable("No space left on device")
    assert [r.getMessage() for r in caplog.records] == [
        f"the disk KV tier in {tmp_path / LAYOUT} is off from now on: No space left on device; "
        "serving goes on without it"]
    assert not disk.lookup(h(0)) and not disk.add(h(1))


def test_a_demoted_block_evicted_from_disk_is_deleted_by_the_next_step_message(tmp_path):
    tiers = TierManager(HostTier(1), DiskTier(tmp_path, LAYOUT, capacity=1), block_size=2)
    kv = KVCacheManager(num_blocks=8, block_size=2, tiers=tiers)
    blocks = {}
    for name, tokens in (("a", [1, 2, 9]), ("b", [3, 4, 9]), ("c", [5, 6, 9])):
        hits, num_cached = kv.get_computed_blocks(name, tokens)
        kv.allocate_slots(name, num_cached, len(tokens) - num_cached, hits)
        kv.cache_blocks(name, tokens, len(tokens))
        blocks[name] = kv.req_hashes[name][0]
        plan = kv.take_transfers()
    # c's write-through evicted b from the host slot; b's demotion evicted a from disk,
    # whose write the previous step message queued: the workers delete it after that write
    assert [w.block_hash for w in plan.to_disk] == [blocks["b"]]
    assert plan.disk_deletes == [blocks["a"]]
    kv.check_integrity()


def test_a_host_tier_smaller_than_a_step_s_write_through_passes_every_block_to_disk(tmp_path):
    # one prompt of 7 full blocks cached in one step, a host tier of 2 slots: the step writes
    # 2 through; the other 5 wait on the device for the next steps, each of which evicts the
    # last one's 2 to disk as it writes 2 more
    tiers = TierManager(HostTier(2), DiskTier(tmp_path, LAYOUT, capacity=16), block_size=2)
    kv = KVCacheManager(num_blocks=16, block_size=2, tiers=tiers)
    tokens = list(range(1, 16))  # 7 full blocks and one token
    hits, num_cached = kv.get_computed_blocks("a", tokens)
    kv.allocate_slots("a", num_cached, len(tokens) - num_cached, hits)
    kv.cache_blocks("a", tokens, len(tokens))
    hashes = kv.req_hashes["a"][:7]
    stored, written = [], []
    for _ in range(4):
        plan = kv.take_transfers()
        stored.append([block_id for block_id, _ in plan.stores])
        written += [w.block_hash for w in plan.to_disk]
        kv.check_integrity()
    assert stored == [[0, 1], [2, 3], [4, 5], [6]]
    assert written == hashes[:5]  # the last two stay in the host tier's two slots
    assert set(tiers.host.hashes()) == set(hashes[5:]) and not tiers.pending
    assert all(block_hash in tiers.disk for block_hash in hashes[:5])
    assert tiers.counters.stored_to_host == 7


def test_a_block_waiting_for_a_host_slot_is_copied_before_the_step_that_reuses_it(tmp_path):
    tiers = TierManager(HostTier(1), None, block_size=2)
    kv = KVCacheManager(num_blocks=4, block_size=2, tiers=tiers)
    tokens = [1, 2, 3, 4, 9]  # 2 full blocks: one is written through, one waits
    hits, num_cached = kv.get_computed_blocks("a", tokens)
    kv.allocate_slots("a", num_cached, len(tokens) - num_cached, hits)
    kv.cache_blocks("a", tokens, len(tokens))
    assert [block_id for block_id, _ in kv.take_transfers().stores] == [0]
    waiting = kv.req_hashes["a"][1]
    assert set(tiers.pending) == {waiting}
    kv.free("a")
    kv.pool.allocate(4)  # the device hands every block out again, the waiting one's too
    # this step's forward would overwrite it: still copied first, in this step's message
    plan = kv.take_transfers()
    assert plan.stores_first == [(1, 0)] and not tiers.pending
