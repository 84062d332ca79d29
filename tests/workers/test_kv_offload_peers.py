"""A shard's copies for another replica: its host slots exported, staged in another shard and
written into its slots by a step's ``HostImport``, bit-exact; and a load whose copies raise is
reported with no block intact, so the engine recomputes it."""

import logging

import pytest
import torch

from kvstore.transfers import BlockLoad, HostImport, KVTransfers
from tests.workers.test_kv_offload import blocks_of, caches, step
from workers.host_layout import layer_tensors
from workers.kv_offload import KVOffloader
from workers.layers.parallel import TensorParallelGroup

SINGLE = TensorParallelGroup.single()


def offloader(seed, num_slots=8):
    return KVOffloader(layer_tensors(caches(torch.bfloat16, seed=seed)), num_slots, None, SINGLE)


def test_blocks_exported_by_one_shard_come_back_bit_exact_from_another_s_host_slots():
    source, target = offloader(seed=1), offloader(seed=2)
    step(source, KVTransfers(stores=[(3, 5), (4, 6)]))  # two blocks in the source's slots 5, 6
    originals = blocks_of(source.tensors, [3, 4])
    rows = source.export([5, 6])
    assert rows.shape == (2, source.layout.block_bytes)
    target.stage_import("imp", rows)
    # row 1 only (the target held the other): into slot 2, then loaded into device block 7
    report = step(target, KVTransfers(imports=[HostImport("imp", [0, 1], [1, 2])],
                                      loads=[BlockLoad("r", [1, 2], [6, 7])]))
    assert report.loaded == {"r": 2} and target.staged == {}
    assert all(torch.equal(a, b) for a, b in zip(originals, blocks_of(target.tensors, [6, 7]),
                                                 strict=True))


def test_staged_blocks_of_another_layout_are_refused_and_an_empty_import_drops_them():
    target = offloader(seed=2)
    with pytest.raises(ValueError, match=f"uint8 rows of {target.layout.block_bytes} bytes"):
        target.stage_import("bad", torch.zeros((1, 8), dtype=torch.uint8))
    target.stage_import("unused", torch.ones((1, target.layout.block_bytes), dtype=torch.uint8))
    before = target.host.clone()
    step(target, KVTransfers(imports=[HostImport("unused", [], [])]))
    assert target.staged == {} and torch.equal(target.host, before)


def test_a_load_whose_copies_raise_is_reported_with_no_block_intact(caplog):
    shard = offloader(seed=3)
    step(shard, KVTransfers(stores=[(0, 0)]))

    def broken(load, failed_slots, in_flight=None):
        raise RuntimeError("copy engine fault")

    shard._load = broken
    with caplog.at_level(logging.WARNING):
        report = step(shard, KVTransfers(loads=[BlockLoad("r", [0], [5])]))
    assert report.loaded == {"r": 0}
    assert "loading 1 KV blocks for r failed (copy engine fault)" in caplog.text
