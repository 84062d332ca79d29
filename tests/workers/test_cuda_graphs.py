"""CUDA-graph bucketing and padding (CPU), and graph replay against eager (GPU)."""

import numpy as np
import pytest
import torch

from workers.cuda_graphs import bucket_for, capture_sizes, pack_padded, packed_size
from workers.input_batch import build_decode_rows, build_input_batch
from workers.request_state import RequestState
from workers.sampler import SamplingSpec
from workers.step_input import ScheduledRequest


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    sizes = capture_sizes(1024)
    assert sizes[-1] == 256 and len(sizes) == 3 + 32


def test_bucket_for():
    sizes = capture_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 9, 16, 17, 64)] == [
        1, 2, 4, 8, 16, 16, 24, 64]
    assert bucket_for(65, sizes) is None


def states_and_steps(block_size=4):
    states = {
        "a": RequestState([5, 6, 7, 8, 9, 10], 5, [3, 7], SamplingSpec(), None),
        "b": RequestState([1, 2, 3], 2, [2], SamplingSpec(), None),
    }
    decode = [ScheduledRequest("a", 5, 1), ScheduledRequest("b", 2, 1)]
    return states, decode


def test_decode_rows_match_the_general_batch():
    states, decode = states_and_steps()
    rows = build_decode_rows(decode, states, block_size=4)
    batch = build_input_batch(decode, states, 4, torch.device("cpu"))
    assert rows.request_ids == batch.sample_request_ids == ["a", "b"]
    assert rows.input_ids.tolist() == batch.input_ids.tolist() == [10, 3]
    assert rows.positions.tolist() == batch.positions.tolist() == [5, 2]
    assert rows.slots.tolist() == batch.meta.slot_mapping.tolist() == [7 * 4 + 1, 2 * 4 + 2]
    assert rows.seq_lens.tolist() == batch.meta.seq_lens.tolist() == [6, 3]
    assert rows.block_tables.tolist() == batch.meta.block_tables.tolist() == [[3, 7], [2, 0]]


def test_not_pure_decode_gives_none():
    states, _ = states_and_steps()
    assert build_decode_rows([ScheduledRequest("a", 3, 3)], states, 4) is None
    assert build_decode_rows([ScheduledRequest("a", 4, 1)], states, 4) is None  # no sample


def test_pack_padded_layout():
    states, decode = states_and_steps()
    rows = build_decode_rows(decode, states, block_size=4)
    packed = pack_padded(rows, bucket=4)
    assert packed.size == packed_size(4, 2) == 4 * 4 + 4 * 2
    fields, table = packed[:16].reshape(4, 4), packed[16:].reshape(4, 2)
    assert fields[0].tolist() == [10, 3, 0, 0]  # input ids
    assert fields[1].tolist() == [5, 2, 0, 0]  # positions
    assert fields[2].tolist() == [29, 10, -1, -1]  # slots: -1 pads, store_kv skips them
    assert fields[3].tolist() == [6, 3, 0, 0]  # seq lens: 0 pads, attention writes zeros
    assert table.tolist() == [[3, 7], [2, 0], [0, 0], [0, 0]]


def test_pack_padded_reuses_a_buffer_without_stale_rows():
    states, decode = states_and_steps()
    buffer = np.full(64, 99, dtype=np.int64)
    rows = build_decode_rows(decode, states, block_size=4)
    packed = pack_padded(rows, bucket=4, out=buffer)
    assert np.shares_memory(packed, buffer) and 99 not in packed.tolist()


@pytest.mark.gpu
def test_graph_replay_matches_eager(tiny_models):
    from cluster.llm import LLM
    from router.sampling_params import SamplingParams

    prompts = [[1, 2, 3, 4, 5], [7] * 20, [9, 8, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(model=str(tiny_models["llama"]), device="cuda", dtype="float32",
                  num_kv_blocks=64, enforce_eager=eager, max_num_seqs=8)
        assert (llm.engine.executor.worker.graphs is None) == eager
        outs[eager] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs[True] == outs[False]
