"""The one-launch MLP (workers/layers/persistent_mlp.py) on the CPU under TRITON_INTERPRET:
its two phases (two launches here: the interpreter runs programs one after another) against
gemv's two launches and the unfused layer; the barrier itself runs on the GPU only."""

# the interpreter fixture; TRITON_INTERPRET itself is set by conftest.py
from tests.workers.triton_interpreter import interpreter_fixes  # noqa: F401, I001

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.workers.test_fused_kernels import assert_close, plain_norm, randn  # noqa: E402
from workers.layers.gemv import gemv  # noqa: E402
from workers.layers.persistent_mlp import new_barrier, persistent_mlp  # noqa: E402

# 3 programs, each several row blocks of gate_up and of down, K in several masked chunks
SMALL = (4, 32, 4, 32, 4)
HIDDEN, INTER = 40, 72


def mlp_weights(dtype):
    gate_up = (randn(2 * INTER, HIDDEN, seed=2) * HIDDEN**-0.5).to(dtype)
    down = (randn(HIDDEN, INTER, seed=3) * INTER**-0.5).to(dtype)
    return gate_up, down, (1 + 0.2 * randn(HIDDEN, seed=4)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_equals_the_two_launches_and_the_unfused_mlp(dtype, with_residual):
    x = randn(1, HIDDEN, dtype=dtype)
    residual = randn(1, HIDDEN, dtype=dtype, seed=1) if with_residual else None
    gate_up, down, norm_weight = mlp_weights(dtype)
    barrier = new_barrier(torch.device("cpu"))
    out, new_residual = persistent_mlp(x, gate_up, down, residual, norm_weight, 1e-5, barrier,
                                       programs=3, config=SMALL)
    act, two_launch_residual = gemv(x, gate_up, residual=residual, norm_weight=norm_weight,
                                    eps=1e-5, silu_mul=True, config=(4, 32, 4, 2))
    two_launch_out, _ = gemv(act, down, config=(4, 32, 4, 2))
    # the same roundings and, with the same chunks, the same sums: equal to the last bit
    assert torch.equal(out, two_launch_out)
    h = x + residual if with_residual else x
    assert torch.equal(new_residual, two_launch_residual if with_residual else x)
    gate, up = F.linear(plain_norm(norm_weight, 1e-5)(h), gate_up).chunk(2, dim=-1)
    assert_close(out, F.linear(F.silu(gate) * up, down), dtype)
    assert barrier.tolist() == [0, 0]  # no barrier in the interpreter


def test_bad_input_is_refused():
    gate_up, down, norm_weight = mlp_weights(torch.float32)
    barrier = new_barrier(torch.device("cpu"))
    args = (None, norm_weight, 1e-5, barrier)
    with pytest.raises(ValueError, match=r"takes one row, got input of shape \(2, 40\)"):
        persistent_mlp(torch.zeros(2, HIDDEN), gate_up, down, *args)
    with pytest.raises(ValueError, match=r"gate_up \(72, 40\) and down \(40, 72\) do not make an "
                                         "MLP of hidden size 40"):
        persistent_mlp(torch.zeros(1, HIDDEN), gate_up[:INTER], down, *args)
    with pytest.raises(ValueError, match="barrier must come from new_barrier"):
        persistent_mlp(torch.zeros(1, HIDDEN), gate_up, down, None, norm_weight, 1e-5,
                       torch.zeros(2, dtype=torch.int32))
