"""In-step loads from the host tier that read its pinned slots in place, layer by layer
(workers/pinned_copies.py): the kernel (interpreted here) bit-exact for every cache layout,
the chunks of layers, the gate the forward waits at (workers/layer_gate.py), the offloader
sending a step's in-step loads through them, and an engine forced onto that path."""

import pytest
import torch

from kvstore.transfers import BlockLoad, KVTransfers
from tests.cluster.engine.test_kv_tiers import (  # noqa: F401 - fixtures: model, expected
    FINDABLE,
    PROMPTS,
    engine,
    expected,
    generate,
    gib,
    hits,
    model,
)
from tests.workers.test_kv_offload import NUM_BLOCKS, bits, blocks_of, caches, stacked
from tests.workers.triton_interpreter import interpreter_fixes  # noqa: F401
from workers.attention.layer_cache import LayerKVCache
from workers.attention.metadata import whole_sequence
from workers.attention.reference import ReferenceAttentionBackend
from workers.block_copies import BlockCopies, word_bytes
from workers.host_layout import BlockLayout, layer_tensors
from workers.kv_offload import KVOffloader
from workers.layer_gate import LayerGate
from workers.layers.parallel import TensorParallelGroup
from workers.loader import load_model
from workers.pinned_copies import PinnedCopies

SINGLE = TensorParallelGroup.single()


def model_and_draft(kv):
    """The model's tensors, then a draft's cache tensor (no per-layer stack of the model's)."""
    draft = torch.randn((NUM_BLOCKS, 4, 1, 8), generator=torch.Generator().manual_seed(9))
    return layer_tensors(kv) + [draft]


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8+scales"])
def test_every_chunk_of_layers_copies_its_layers_shares_bit_exact(kind):
    dtype = getattr(torch, kind.split("+")[0])
    kv = stacked(caches(dtype, seed=3, layers=3, scales=kind == "int8+scales"))
    tensors = model_and_draft(kv)
    layout = BlockLayout.of(tensors, tp_size=1)
    host = torch.randint(0, 256, (5, layout.block_bytes), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(4))
    copies = PinnedCopies(host, BlockCopies(tensors, layout), 3, len(tensors) - 1)
    assert [k.per_layer for k in copies.kinds] == (
        [True] * 4 if kind == "int8+scales" else [True] * 2) + [False]
    slots, blocks = torch.tensor([4, 0, 2]), torch.tensor([6, 1, 3])
    before = blocks_of(tensors, list(range(NUM_BLOCKS)))
    copies.load(slots, blocks, 1, 2)  # the middle layer alone: nothing else moves
    after = blocks_of(tensors, list(range(NUM_BLOCKS)))
    changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if
               not torch.equal(a, b)]
    per_layer = 4 if kind == "int8+scales" else 2
    assert changed == list(range(per_layer, 2 * per_layer))  # layer 1's tensors, in order
    copies.load(slots, blocks, 0, 1)  # the first chunk brings the draft's tensor too
    copies.load(slots, blocks, 2, 3)
    rows = torch.zeros((3, layout.block_bytes), dtype=torch.uint8)
    BlockCopies(tensors, layout).gather(blocks, rows)
    assert torch.equal(rows, host[slots])
    untouched = [0, 2, 4, 5, 7]
    assert all(torch.equal(a[untouched], bits(t[untouched])) for a, t in
               zip(before, tensors, strict=True))


def test_chunks_cover_every_layer_once_in_order():
    kv = stacked(caches(torch.float32, layers=10))
    tensors = layer_tensors(kv)
    layout = BlockLayout.of(tensors, tp_size=1)
    host = torch.zeros((1, layout.block_bytes), dtype=torch.uint8)
    copies = PinnedCopies(host, BlockCopies(tensors, layout), 10, len(tensors))
    assert copies.chunks() == [(0, 1), (1, 2), (2, 4), (4, 5), (5, 6), (6, 8), (8, 9), (9, 10)]
    assert copies.chunks(3) == [(0, 3), (3, 7), (7, 10)]
    assert copies.chunks(20) == [(i, i + 1) for i in range(10)]


def test_the_kernel_moves_the_widest_word_the_layout_allows():
    class Group:
        def __init__(self, offset, stride, size):
            self.offset, self.stride = offset, stride
            self.cache = torch.zeros((1, 1, size), dtype=torch.uint8)

    assert word_bytes(64, [Group(0, 16, 8), Group(8, 16, 8)]) == 8
    assert word_bytes(24, [Group(0, 12, 4), Group(4, 12, 8)]) == 4
    assert word_bytes(6, [Group(0, 0, 6)]) == 2
    assert word_bytes(64, [Group(3, 0, 61)]) == 1


def test_the_gate_waits_once_for_the_chunk_of_each_layer():
    waits = []
    gate = LayerGate(waits.append)
    gate.before_layer(0)  # nothing armed: no wait
    gate.wait_all()
    gate.arm([(0, "a"), (3, "b"), (6, "c")])
    gate.before_layer(0)
    gate.before_layer(1)
    gate.before_layer(2)
    assert waits == ["a"]
    gate.before_layer(7)  # past "b" and into "c": "c" alone covers both (one stream, in order)
    gate.before_layer(8)
    gate.wait_all()
    assert waits == ["a", "c"]
    gate.arm([(0, "a"), (3, "b")])
    gate.wait_all()  # a graph's replay, or the step's end
    gate.before_layer(5)
    assert waits == ["a", "c", "b"]


def offloader_with_layers(kv, in_place=True):
    tensors = layer_tensors(kv)
    return tensors, KVOffloader(tensors, num_slots=6, disk_dir=None, tp=SINGLE,
                                model_layers=(len(kv), len(tensors)), in_place=in_place)


def test_a_step_s_in_step_loads_go_layer_by_layer_and_the_others_whole_blocks(monkeypatch):
    kv = stacked(caches(torch.bfloat16, seed=6, layers=3))
    tensors, offloader = offloader_with_layers(kv)
    originals = blocks_of(tensors, [1, 2, 5])
    offloader.before_step(KVTransfers(stores_first=[(1, 3), (2, 0), (5, 4)]), [], [])
    offloader.after_step(None)
    for t in tensors:
        t.zero_()
    armed, whole = [], []
    monkeypatch.setattr(offloader.gate, "arm", lambda chunks: armed.append(
        [first for first, _ in chunks]) or LayerGate.arm(offloader.gate, chunks))
    load_one = offloader._load
    monkeypatch.setattr(offloader, "_load", lambda load, *a: whole.append(load.request_id)
                        or load_one(load, *a))
    transfers = KVTransfers(loads=[BlockLoad("a", [3, 0], [6, 7], in_step=True),
                                   BlockLoad("w", [4], [2]),
                                   BlockLoad("b", [4], [0], in_step=True)])
    offloader.before_step(transfers, [6, 7, 0], [])
    assert armed == [[0, 1, 2]] and whole == ["w"]  # one layered pass for both in-step loads
    assert [first for first, _ in offloader.gate.pending] == [1, 2]  # chunk 0: before the step
    offloader.after_step(transfers)
    assert offloader.gate.pending == []
    assert offloader.report(idle=False).loaded == {"w": 1, "a": 2, "b": 1}
    assert all(torch.equal(a[:2], b) for a, b in zip(originals, blocks_of(tensors, [6, 7]),
                                                     strict=True))
    assert all(torch.equal(a[2], b[0]) and torch.equal(a[2], c[0]) for a, b, c in
               zip(originals, blocks_of(tensors, [2]), blocks_of(tensors, [0]), strict=True))


def test_on_the_cpu_copies_are_staged_unless_asked_and_a_gpu_probe_decides_there():
    kv = stacked(caches(torch.float32, layers=2))
    assert offloader_with_layers(kv, in_place=None)[1].pinned is None
    assert offloader_with_layers(kv, in_place=False)[1].pinned is None
    assert offloader_with_layers(kv, in_place=True)[1].pinned is not None
    no_model = KVOffloader(layer_tensors(kv), num_slots=2, disk_dir=None, tp=SINGLE,
                           in_place=True)
    assert no_model.pinned is None  # no forward waits layer by layer: nothing to split


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_the_model_waits_at_the_gate_before_each_layer(tiny_models, fused, num_tokens):
    ours, config = load_model(tiny_models["llama"], torch.float32, "cpu", SINGLE,
                              ReferenceAttentionBackend(), fused=fused)
    seen = []

    class Gate:
        def before_layer(self, index):
            seen.append(index)

    ours.model.layer_gate = Gate()
    heads, dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    kv = [LayerKVCache(torch.zeros(4, 4, heads, dim), torch.zeros(4, 4, heads, dim))
          for _ in range(config.num_hidden_layers)]
    meta = whole_sequence(num_tokens, 4, torch.device("cpu"))
    ours(torch.arange(5, 5 + num_tokens), torch.arange(num_tokens), kv, meta)
    assert seen == list(range(config.num_hidden_layers))


def test_host_hits_loaded_layer_by_layer_give_the_same_tokens(model, expected, monkeypatch):  # noqa: F811
    """The in-place path forced on the CPU, its kernel interpreted: each loading step's
    forward waits for its second chunk of layers at layer 1."""
    monkeypatch.setattr(KVOffloader, "_in_place_copies_work", lambda self: True)
    off = engine(model, host_kv_cache_gb=gib(1))
    assert off.engine.executor.worker.offloader.pinned is None  # off unless asked
    assert off.engine.executor.worker.model.model.layer_gate is None  # no wait a layer
    llm = engine(model, host_kv_cache_gb=gib(100), host_loads_in_place=True)
    gate = llm.engine.executor.worker.offloader.gate
    arms, waits = [], []
    monkeypatch.setattr(gate, "arm", lambda chunks: arms.append(
        [first for first, _ in chunks]) or LayerGate.arm(gate, chunks))
    monkeypatch.setattr(gate, "_wait", waits.append)
    generate(llm)
    llm.engine.scheduler.kv.reset_prefix_cache()
    assert generate(llm) == expected
    assert hits(llm)[1] == FINDABLE
    # a load a prompt (one at a time): chunk 0 before the step, chunk 1 before layer 1
    assert arms == [[0, 1]] * len(PROMPTS) and len(waits) == 2 * len(PROMPTS)
