"""Matrix products whose every row is the same bits however many rows share the call.

Why: a quantized KV cache turns the last bit of a key into a whole quantum. The CPU's GEMM
picks its kernel and reduction order by the number of rows, so a prompt token's K computed in
a prefill of 36 rows and in a chunk of 4 (a prefix hit on the other 32) can differ in the last
bit; in float32 that is noise, but where it crosses an int8 or fp8 rounding boundary the
stored key moves by a step, and greedy output came to depend on what the cache held before
(the default model, fp8: "Explain photosynthesis in one sentence." gave 28 tokens cold and 27
as a prefix hit). With every product taken in tiles of ``ROWS`` rows of one shape, a row's
arithmetic is fixed whatever its neighbours: cold, as a prefix hit, chunked, alone or in a
batch, and recomputed after a preemption. Attention, per sequence already, takes each query
as the decode row it would be (workers/attention/reference.py, ``attend_rows_alone``): SDPA's
causal, masked and one-query paths round differently.

The price, on this 2-core CPU: a product of one row ~0.4 ms where a GEMV takes 0.06-0.08 (576
x 1536, 1536 x 576), of 512 rows 1.3-2x one GEMM's time. On only where it decides the answer:
a quantized cache on the CPU (``needed_for``). On the GPU cuBLAS and the Triton attention
kernels are no more row-invariant, and tiles would cost the prefill's throughput: there a
quantized cache's greedy output may still change with the batch (docs/kv-cache.md).
"""

import torch
import torch.nn as nn

ROWS = 16  # one tile's rows: every product is a batch of (ROWS, in) @ (in, out)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, in) @ weight.T (+ bias) -> (T, out), each row's bits independent of T and of
    the other rows."""
    rows, width = x.shape
    pad = -rows % ROWS
    if pad:
        x = torch.cat([x, x.new_zeros(pad, width)])
    tiles = (rows + pad) // ROWS
    # bmm, not matmul: matmul folds a batch times a matrix into one GEMM of all the rows, and
    # the GEMM's kernel is chosen by its row count again
    out = torch.bmm(x.view(tiles, ROWS, width), weight.t().expand(tiles, width, -1))
    out = out.view(rows + pad, -1)[:rows]
    return out if bias is None else out + bias


def needed_for(device: torch.device, kv_quantized: bool) -> bool:
    """Whether a model on ``device`` takes its products in tiles: a quantized cache on the
    CPU (see the module's docstring)."""
    return kv_quantized and device.type == "cpu"


def make_batch_invariant(model: nn.Module) -> int:
    """Sets every sharded linear layer and LM head of ``model`` to ``invariant_linear``, and
    its attention to rows attended alone (workers/attention/reference.py); returns how many
    layers. ValueError for an attention backend that cannot (Triton's kernels tile by the
    call's shape)."""
    from workers.attention.reference import ReferenceAttentionBackend
    from workers.layers.embedding import ParallelLMHead
    from workers.layers.linear import ShardedLinear

    layers = [m for m in model.modules() if isinstance(m, ShardedLinear | ParallelLMHead)]
    for layer in layers:
        layer.batch_invariant = True
    for backend in {id(m.backend): m.backend for m in model.modules() if hasattr(m, "backend")
                    }.values():
        if not isinstance(backend, ReferenceAttentionBackend):
            raise ValueError(f"the {backend.name} attention backend gives no batch-invariant "
                             "rows: a quantized KV cache on the CPU takes the reference backend")
        backend.rows_alone = True
    return len(layers)
