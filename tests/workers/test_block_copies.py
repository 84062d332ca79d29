"""A batch of KV blocks to and from staging rows (workers/block_copies.py): caches stacked
over the layers move in one gather or scatter per kind, the rest one tensor at a time, and
the rows hold the slot layout either way: every tensor's share of a block, back to back."""

import pytest
import torch
from transformers import LlamaConfig

from kvstore.kv_format import INT8
from tests.workers.test_kv_cache import HEAD_DIM_64
from workers.block_copies import BlockCopies
from workers.host_layout import BlockLayout, layer_tensors
from workers.kv_cache import allocate_kv_caches

NUM_BLOCKS, BLOCK_SIZE = 6, 4
CONFIG = LlamaConfig(**(HEAD_DIM_64 | {"num_hidden_layers": 3}))


def randomized(tensors):
    generator = torch.Generator().manual_seed(3)
    for tensor in tensors:
        raw = tensor.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=generator, dtype=torch.uint8))
    return tensors


def cache_tensors(kv_format=None):
    caches = allocate_kv_caches(CONFIG, 1, NUM_BLOCKS, BLOCK_SIZE, torch.bfloat16,
                                torch.device("cpu"), kv_format)
    features = torch.empty((NUM_BLOCKS * BLOCK_SIZE, 10)).view(NUM_BLOCKS, BLOCK_SIZE, 10)
    return randomized(layer_tensors(caches) + [features])  # an EAGLE head's, a view too


def bits(tensor):
    return tensor.contiguous().view(torch.uint8)


def slot_bytes(tensors, block_ids):
    """The slot layout written out by hand: each tensor's block, as bytes, back to back."""
    ids = torch.tensor(block_ids)
    return torch.cat([t.index_select(0, ids).reshape(len(block_ids), -1).view(torch.uint8)
                      for t in tensors], dim=1)


@pytest.mark.parametrize("kv_format", [None, INT8], ids=["bfloat16", "int8"])
def test_stacked_caches_move_in_one_kernel_a_kind_and_keep_the_slot_layout(kv_format):
    tensors = cache_tensors(kv_format)
    layout = BlockLayout.of(tensors, tp_size=1)
    copies = BlockCopies(tensors, layout)
    kinds = 4 if kv_format else 2  # K, V (and their scales), each over the 3 layers
    assert [group.cache.shape[0] for group in copies.groups] == [3] * kinds + [1]
    assert copies.width == 8  # the index kernels move 8-byte words
    stage = torch.zeros((8, layout.block_bytes), dtype=torch.uint8)
    blocks = [4, 0, 5]
    copies.gather(torch.tensor(blocks), stage[:3])
    want = slot_bytes(tensors, blocks)
    assert torch.equal(stage[:3], want) and not stage[3:].any()
    originals = [t.clone() for t in tensors]
    for tensor in tensors:
        tensor.zero_()
    copies.scatter(torch.tensor([1, 3, 2]), stage[:3])  # block 4's bytes into block 1, ...
    for original, tensor in zip(originals, tensors, strict=True):
        assert torch.equal(bits(tensor[[1, 3, 2]]), bits(original[blocks]))  # NaNs too
        assert not bits(tensor[[0, 4, 5]]).any()


def test_separate_tensors_move_one_by_one_with_the_same_bytes():
    tensors = randomized([torch.empty((NUM_BLOCKS, BLOCK_SIZE, 2, 8), dtype=dtype)
                          for dtype in (torch.float16, torch.int8, torch.float32)])
    layout = BlockLayout.of(tensors, tp_size=1)
    copies = BlockCopies(tensors, layout)
    assert len(copies.groups) == 3
    stage = torch.empty((2, layout.block_bytes), dtype=torch.uint8)
    copies.gather(torch.tensor([2, 5]), stage)
    assert torch.equal(stage, slot_bytes(tensors, [2, 5]))


def test_the_widest_word_the_layout_and_storage_allow_gives_the_same_bytes():
    tensors = randomized([torch.empty((NUM_BLOCKS, BLOCK_SIZE, 3), dtype=torch.uint8),
                          torch.empty((NUM_BLOCKS, BLOCK_SIZE, 2), dtype=torch.float16)])
    layout = BlockLayout.of(tensors, tp_size=1)
    copies = BlockCopies(tensors, layout)
    assert copies.width == 4  # offsets 0 and 12, sizes 12 and 16 bytes
    stage = torch.empty((2, layout.block_bytes), dtype=torch.uint8)
    copies.gather(torch.tensor([5, 1]), stage)
    assert torch.equal(stage, slot_bytes(tensors, [5, 1]))
    shifted = randomized([torch.empty(NUM_BLOCKS * 8 + 2, dtype=torch.uint8)])[0]
    shifted = [shifted[2:].view(NUM_BLOCKS, 8)]  # starts 2 bytes into its storage
    copies = BlockCopies(shifted, BlockLayout.of(shifted, tp_size=1))
    assert copies.width == 2
    stage = torch.empty((1, 8), dtype=torch.uint8)
    copies.gather(torch.tensor([3]), stage)
    assert torch.equal(stage, slot_bytes(shifted, [3]))
    odd = randomized([torch.empty((NUM_BLOCKS, 1, 3), dtype=torch.uint8)])
    copies = BlockCopies(odd, BlockLayout.of(odd, tp_size=1))
    assert copies.width == 1
    stage = torch.empty((1, 3), dtype=torch.uint8)
    copies.gather(torch.tensor([4]), stage)
    assert torch.equal(stage, slot_bytes(odd, [4]))


def test_a_stack_missing_a_layer_moves_tensor_by_tensor():
    stacked = randomized([torch.empty((3, NUM_BLOCKS, BLOCK_SIZE, 8))])[0]
    tensors = [stacked[0], stacked[2]]  # layer 1 is not offloaded: no single gather fits
    copies = BlockCopies(tensors, BlockLayout.of(tensors, tp_size=1))
    assert [group.cache.shape[0] for group in copies.groups] == [1, 1]
    stage = torch.empty((1, copies.block_bytes), dtype=torch.uint8)
    copies.gather(torch.tensor([3]), stage)
    assert torch.equal(stage, slot_bytes(tensors, [3]))


def test_a_tensor_that_is_not_contiguous_is_refused():
    tensor = torch.zeros((NUM_BLOCKS, BLOCK_SIZE, 8)).transpose(1, 2)
    with pytest.raises(ValueError, match=r"cache tensor 0 of shape \(6, 8, 4\) is not "
                                         "contiguous"):
        BlockCopies([tensor], BlockLayout.of([tensor], tp_size=1))
