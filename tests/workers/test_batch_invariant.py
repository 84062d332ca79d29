"""Batch-invariant products and attention: a row's bits do not depend on the other rows of
its call, so a quantized cache stores the same key however a token was computed."""

import pytest
import torch
import torch.nn.functional as F

from workers.attention.reference import ReferenceAttentionBackend, attend_rows_alone
from workers.layers.batch_invariant import (
    ROWS,
    invariant_linear,
    make_batch_invariant,
    needed_for,
)
from workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from workers.layers.parallel import TensorParallelGroup


@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576), (576, 960)])
def test_a_row_s_product_is_the_same_bits_in_a_call_of_any_size(shape):
    in_features, out_features = shape
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(320, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    whole = invariant_linear(x, weight, bias)
    assert whole.shape == (320, out_features)
    for start, rows in ((0, 1), (37, 1), (37, 4), (5, ROWS + 3), (100, 213)):
        part = invariant_linear(x[start : start + rows], weight, bias)
        assert torch.equal(part, whole[start : start + rows])
    # what F.linear gives, up to rounding: the product is the same product
    torch.testing.assert_close(whole, F.linear(x, weight, bias), rtol=1e-4, atol=1e-3)


def test_each_query_attends_as_the_decode_row_it_would_be():
    generator = torch.Generator().manual_seed(0)
    length, new = 50, 7  # 43 tokens of context, then 7 new ones
    q = torch.randn(1, 9, new, 64, generator=generator)
    k = torch.randn(1, 3, length, 64, generator=generator)
    v = torch.randn(1, 3, length, 64, generator=generator)
    out = attend_rows_alone(q, k, v, scale=0.125)
    assert out.shape == (new, 9, 64)
    for j in range(new):
        end = length - new + j + 1
        decode = F.scaled_dot_product_attention(q[:, :, j : j + 1], k[:, :, :end],
                                                v[:, :, :end], scale=0.125, enable_gqa=True)
        assert torch.equal(out[j], decode[0, :, 0])


def test_a_model_is_made_batch_invariant_where_a_quantized_cache_is_on_the_cpu():
    assert needed_for(torch.device("cpu"), kv_quantized=True)
    assert not needed_for(torch.device("cpu"), kv_quantized=False)
    assert not needed_for(torch.device("cuda"), kv_quantized=True)

    class Layer(torch.nn.Module):
        def __init__(self, backend):
            super().__init__()
            self.backend = backend
            tp = TensorParallelGroup.single()
            self.up = ColumnParallelLinear(8, 16, bias=False, tp=tp)
            self.down = RowParallelLinear(16, 8, bias=False, tp=tp)

    backend = ReferenceAttentionBackend()
    model = torch.nn.Sequential(Layer(backend), Layer(backend))
    assert make_batch_invariant(model) == 4
    assert backend.rows_alone and all(layer.up.batch_invariant for layer in model)
    assert not ReferenceAttentionBackend().rows_alone  # a class default, not shared state

    class Kernels:
        name = "triton"

    with pytest.raises(ValueError) as error:
        make_batch_invariant(Layer(Kernels()))
    assert str(error.value) == ("the triton attention backend gives no batch-invariant rows: a "
                                "quantized KV cache on the CPU takes the reference backend")
