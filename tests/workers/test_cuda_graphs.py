"""CUDA-graph bucketing and padding (CPU), and graph replay against eager (GPU)."""

import numpy as np
import pytest
import torch

from workers.cuda_graphs import StaticInputs, bucket_for, capture_sizes, pack_padded, packed_size
from workers.input_batch import build_decode_rows, build_input_batch, decode_batch
from workers.request_state import RequestState
from workers.sampler import SamplingSpec
from workers.step_input import ScheduledRequest


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    sizes = capture_sizes(1024)
    assert sizes[-1] == 512 and len(sizes) == 3 + 64


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
    assert packed.size == packed_size(4, 2) == 5 * 4 + 4 * 2
    fields, table = packed[:20].reshape(5, 4), packed[20:].reshape(4, 2)
    assert fields[0].tolist() == [10, 3, 0, 0]  # input ids
    assert fields[1].tolist() == [5, 2, 0, 0]  # positions
    assert fields[2].tolist() == [29, 10, -1, -1]  # slots: -1 pads, store_kv skips them
    assert fields[3].tolist() == [6, 3, 0, 0]  # seq lens: 0 pads, attention writes zeros
    assert fields[4].tolist() == [0, 1, 2, 3]  # decode order: longest first, padding last
    assert table.tolist() == [[3, 7], [2, 0], [0, 0], [0, 0]]


def test_decode_order_puts_the_longest_context_first():
    """Eager and graphed decode steps hand the decode kernel the rows longest first; a step of
    one row has no order (its kernel skips the load)."""
    states, decode = states_and_steps()
    rows = build_decode_rows(decode[::-1], states, block_size=4)  # b (3 tokens), then a (6)
    assert decode_batch(rows, torch.device("cpu")).meta.decode_order.tolist() == [1, 0]
    assert pack_padded(rows, bucket=4)[16:20].tolist() == [1, 0, 2, 3]
    one = build_decode_rows(decode[:1], states, block_size=4)
    assert decode_batch(one, torch.device("cpu")).meta.decode_order is None


def test_pack_padded_reuses_a_buffer_without_stale_rows():
    states, decode = states_and_steps()
    buffer = np.full(64, 99, dtype=np.int64)
    rows = build_decode_rows(decode, states, block_size=4)
    packed = pack_padded(rows, bucket=4, out=buffer)
    assert np.shares_memory(packed, buffer) and 99 not in packed.tolist()


def test_static_inputs_load_fills_the_bucket_and_keeps_the_rest():
    states, decode = states_and_steps()
    rows = build_decode_rows(decode, states, block_size=4)
    inputs = StaticInputs.allocate(max_batch=8, max_blocks=3, device=torch.device("cpu"))
    inputs.block_tables.fill_(9)
    inputs.load(torch.from_numpy(pack_padded(rows, bucket=4)), bucket=4, width=2)
    assert inputs.input_ids.tolist() == [10, 3, 0, 0, 0, 0, 0, 0]
    assert inputs.positions.tolist() == [5, 2, 0, 0, 0, 0, 0, 0]
    assert inputs.slot_mapping.tolist() == [29, 10, -1, -1, -1, -1, -1, -1]
    assert inputs.seq_lens.tolist() == [6, 3, 0, 0, 0, 0, 0, 0]
    assert inputs.decode_order.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert (inputs.seq_lens.dtype, inputs.decode_order.dtype) == (torch.int32, torch.int32)
    # the bucket's rows take the step's `width` columns; the third column keeps stale blocks
    assert inputs.block_tables[:5].tolist() == [[3, 7, 9], [2, 0, 9], [0, 0, 9], [0, 0, 9],
                                                [9, 9, 9]]
    meta = inputs.metadata(bucket=4, max_seq_len=12, num_splits=2)
    assert meta.slot_mapping.tolist() == [29, 10, -1, -1]
    assert meta.seq_lens.tolist() == [6, 3, 0, 0]


@pytest.mark.gpu
def test_graph_replay_and_decode_steps_match_eager(tiny_models):
    """Eager one step a call = graphs one step a call = graphs 8 steps a call (tokens fed on
    the device) = the same with the lookahead step = graphs with async scheduling (each call
    launches a step whose inputs are the step before's unread samples), greedy and seeded
    sampling alike."""
    from cluster.engine.llm import LLM
    from router.sampling_params import SamplingParams

    prompts = [[1, 2, 3, 4, 5], [7] * 20, [9, 8, 7]]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=24, ignore_eos=True)
    outs = {}
    runs = [(True, 1, False, False), (False, 1, False, False), (False, 8, False, False),
            (False, 8, True, False), (False, 1, False, True)]
    for eager, steps, lookahead, run_ahead in runs:
        llm = LLM(model=str(tiny_models["llama"]), device="cuda", dtype="float32",
                  num_kv_blocks=64, enforce_eager=eager, max_num_seqs=8, decode_steps=steps,
                  decode_lookahead=lookahead, async_scheduling=run_ahead)
        assert (llm.engine.executor.worker.graphs is None) == eager
        outs[eager, steps, lookahead, run_ahead] = [
            [o.token_ids for o in llm.generate(prompts, params)] for params in (greedy, seeded)]
    assert all(outs[run] == outs[runs[0]] for run in runs), outs


def test_collective_capture_problem():
    from workers.cuda_graphs import collective_capture_problem

    assert collective_capture_problem(1, None) is None  # one rank: no collectives in the graph
    assert collective_capture_problem(2, (2, 9, 6)) is None
    assert collective_capture_problem(2, (2, 27, 3)) is None
    assert collective_capture_problem(2, 21806) is None  # old torch: one int, 2.18.6
    assert "2.8.4" in collective_capture_problem(2, (2, 8, 4))
    assert "2.7.8" in collective_capture_problem(2, 2708)  # NCCL < 2.9 codes: 2708 = 2.7.8
    assert collective_capture_problem(2, None) is not None


class FakeGroup:
    """A TP group whose other ranks answer ``others`` to each agreement, in order."""

    def __init__(self, others: list[bool], size: int = 2) -> None:
        self.rank, self.size, self.others, self.asked = 0, size, list(others), []

    def all_true(self, flag: bool, device) -> bool:
        self.asked.append(flag)
        return flag and self.others.pop(0)


class FakeGraphs:
    def __init__(self, problem=None):
        self.problem, self.calls = problem, []

    def warm_up(self):
        self.calls.append("warm_up")

    def capture(self, capture_error_mode):
        self.calls.append(capture_error_mode)
        return self.problem


def capture(graphs, group, nccl=(2, 21, 5)):
    from workers.cuda_graphs import capture_on_every_rank

    def make():
        if isinstance(graphs, Exception):
            raise graphs
        return graphs

    return capture_on_every_rank(make, group, torch.device("cpu"), lambda: nccl)


def test_every_rank_captured_gives_graphs():
    graphs, group = FakeGraphs(), FakeGroup([True, True])
    assert capture(graphs, group) is graphs
    assert graphs.calls == ["warm_up", "thread_local"] and group.asked == [True, True]


def test_one_rank_captures_alone_and_runs_graphs():
    graphs, group = FakeGraphs(), FakeGroup([], size=1)
    group.all_true = lambda flag, device: flag  # TensorParallelGroup.single()
    assert capture(graphs, group, nccl=None) is graphs
    assert graphs.calls == ["warm_up", "global"]


def test_a_local_capture_failure_turns_graphs_off_after_agreeing():
    graphs, group = FakeGraphs(problem="capture failed"), FakeGroup([True, False])
    assert capture(graphs, group) is None
    assert group.asked == [True, False]  # it still joins the second agreement


def test_another_ranks_failure_turns_graphs_off_here_too():
    graphs, group = FakeGraphs(), FakeGroup([True, False])
    assert capture(graphs, group) is None
    assert graphs.calls == ["warm_up", "thread_local"] and group.asked == [True, True]


def test_a_failed_setup_skips_the_warm_up_on_every_rank():
    for graphs, nccl in ((RuntimeError("out of pinned memory"), (2, 21, 5)),
                         (FakeGraphs(), (2, 8, 4))):
        group = FakeGroup([True])
        assert capture(graphs, group, nccl) is None
        assert group.asked == [False]  # one agreement, then no collective at all
        if isinstance(graphs, FakeGraphs):
            assert graphs.calls == []
    graphs, group = FakeGraphs(), FakeGroup([False])  # the other rank's setup failed
    assert capture(graphs, group) is None and graphs.calls == []


def test_uses_graphs_needs_cuda_triton_and_no_enforce_eager(tiny_models):
    from workers.worker import Worker, WorkerConfig

    worker = Worker(WorkerConfig(str(tiny_models["llama"])))
    assert not worker.uses_graphs  # CPU: eager, reference attention


