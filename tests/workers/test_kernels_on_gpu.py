"""Kernels that only a GPU can run as they are meant to: the persistent MLP's grid barrier
(the interpreter runs programs one after another; tests/workers/test_persistent_mlp.py covers
its arithmetic on the CPU)."""

import pytest
import torch


@pytest.mark.gpu
def test_persistent_mlp_replayed_in_a_graph_matches_the_two_launches():
    from workers.layers.gemv import gemv
    from workers.layers.persistent_mlp import barrier_missed, new_barrier, persistent_mlp

    torch.manual_seed(0)
    layers, hidden, inter, device = 16, 2048, 8192, torch.device("cuda")

    def randn(*shape, scale=1.0):
        return torch.randn(shape, device=device, dtype=torch.bfloat16) * scale

    weights = [(randn(2 * inter, hidden, scale=hidden**-0.5), randn(hidden, inter,
                scale=inter**-0.5), 1 + 0.1 * randn(hidden)) for _ in range(layers)]
    x, residual = randn(1, hidden), randn(1, hidden)
    barrier = new_barrier(device)
    programs = torch.cuda.get_device_properties(device).multi_processor_count

    def persistent():
        return [persistent_mlp(x, gate_up, down, residual, norm, 1e-5, barrier)
                for gate_up, down, norm in weights]

    persistent()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = persistent()
    replays = 50
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    assert not barrier_missed(barrier)
    # every program of every launch arrived exactly once
    assert barrier[0].item() == (replays + 1) * layers * programs
    for (out, new_residual), (gate_up, down, norm) in zip(outs, weights, strict=True):
        act, expected_residual = gemv(x, gate_up, residual=residual, norm_weight=norm, eps=1e-5,
                                      silu_mul=True)
        expected, _ = gemv(act, down)
        assert torch.equal(new_residual, expected_residual)
        # the same roundings; sums in other tiles: bfloat16's last bit at most, here and there
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
