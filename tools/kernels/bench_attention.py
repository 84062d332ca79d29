"""GPU check of the Triton attention backend: correctness against the reference at real shapes,
CUDA-graph capture of decode, and the decode kernel's time and KV-read bandwidth.

Run on a CUDA machine:  python -m tools.kernels.bench_attention
Shapes are Llama-3.2-1B's attention: 32 query heads, 8 kv heads, head_dim 64, block size 16.
"""

import torch

from workers.attention.layer_cache import LayerKVCache
from workers.attention.metadata import AttentionMetadata
from workers.attention.reference import ReferenceAttentionBackend
from workers.attention.triton_backend import TritonAttentionBackend, num_sms
from workers.attention.triton_decode import choose_num_splits, decode_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 64, 16
BATCH_SIZES = (1, 64)
CONTEXTS = (128, 512, 1024, 2048, 4096)
DTYPES = (torch.bfloat16, torch.float32)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
TIMED_RUNS = 100


def make_batch(
    seq_lens: list[int], q_lens: list[int], dtype: torch.dtype, device: str = "cuda", seed: int = 0
):
    """q/k/v for the new tokens, caches holding random prefixes, and metadata with shuffled
    block tables."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    order = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros((len(seq_lens), max(blocks_per_seq)), dtype=torch.int32)
    slots, taken = [], 0
    for i, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens, strict=True)):
        owned = order[taken : taken + blocks_per_seq[i]]
        taken += blocks_per_seq[i]
        block_tables[i, : len(owned)] = owned.int()
        pos = torch.arange(seq_len - q_len, seq_len)
        slots.append(owned[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)

    query_start_loc = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(q_lens),
        seq_lens_cpu=list(seq_lens),
    )

    def randn(*shape):
        return torch.randn(shape, device=device, dtype=dtype)

    num_tokens, cache_shape = sum(q_lens), (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    q = randn(num_tokens, HEADS, HEAD_DIM)
    k, v = randn(num_tokens, KV_HEADS, HEAD_DIM), randn(num_tokens, KV_HEADS, HEAD_DIM)
    return q, k, v, randn(*cache_shape), randn(*cache_shape), meta


def compare(batch, dtype) -> tuple[bool, float]:
    """Whether the two backends agree within the dtype's tolerance, and their largest
    difference; the caches they write must be identical."""
    q, k, v, k_cache, v_cache, meta = batch
    scale = HEAD_DIM**-0.5
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = ReferenceAttentionBackend().forward(q, k, v, LayerKVCache(k_ref, v_ref), meta,
                                                   scale).float()
    got = TritonAttentionBackend().forward(q, k, v, LayerKVCache(k_cache, v_cache), meta,
                                           scale).float()
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref), "store_kv differs"
    tol = TOLERANCE[dtype]  # relative too: one bf16 ulp of an output near 4 is 0.03
    ok = torch.allclose(got, expected, atol=tol, rtol=tol)
    return ok, (got - expected).abs().max().item()


def check_correctness() -> bool:
    all_ok = True
    for dtype in DTYPES:
        for batch_size in BATCH_SIZES:
            for context in CONTEXTS:
                lens = [context - 7 * i % max(context // 2, 1) for i in range(batch_size)]
                cases = {
                    "decode": (lens, [1] * batch_size),
                    "extend": (lens, [min(37, n) for n in lens]),
                }
                for kind, (seq_lens, q_lens) in cases.items():
                    ok, error = compare(make_batch(seq_lens, q_lens, dtype), dtype)
                    all_ok &= ok
                    print(
                        f"{'ok ' if ok else 'BAD'} {kind:6} {str(dtype):14} batch {batch_size:3}"
                        f"  context {context:5}  max error {error:.2e}"
                    )
    mixed = ([900, 1, 300, 2048], [1, 1, 300, 64])  # decodes, a whole prompt, a chunk
    ok, error = compare(make_batch(*mixed, torch.bfloat16), torch.bfloat16)
    all_ok &= ok
    print(f"{'ok ' if ok else 'BAD'} mixed decode + prefill bf16: max error {error:.2e}")
    return all_ok


def check_cuda_graph() -> bool:
    """Capture decode with a fixed split count, then replay it after the lengths change."""
    q, _, _, k_cache, v_cache, meta = make_batch([3000, 17, 1, 640], [1] * 4, torch.bfloat16)
    scale, num_splits = HEAD_DIM**-0.5, 8
    args = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, num_splits)
    out = decode_attention(*args)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(*args, out=out)
    meta.seq_lens.copy_(torch.tensor([2000, 16, 0, 639], dtype=torch.int32))
    graph.replay()
    expected = decode_attention(*args)
    ok = torch.equal(out, expected) and not out[2].any()
    print(f"{'ok ' if ok else 'BAD'} CUDA graph replay of decode with new seq_lens")
    return ok


def median_ms(fn) -> float:
    """Median GPU time of fn over TIMED_RUNS runs, each starting with a cold L2: the KV of a
    small batch (8 MiB at batch 1, context 4096, bf16) would otherwise stay in the 50 MiB L2."""
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    for _ in range(5):
        fn()
    times = []
    for _ in range(TIMED_RUNS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flush.zero_()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graphed(run) -> torch.cuda.CUDAGraph:
    """run() captured in a CUDA graph, as the model runner runs kernels: timing its replay
    leaves out Triton's Python launch overhead, which would dominate small batches. One eager
    call first compiles the kernels outside the capture."""
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph


def graphed_decode(args: tuple, num_splits: int):
    return graphed(lambda: decode_attention(*args, num_splits))


def time_decode() -> None:
    print(f"\ndecode kernels in a CUDA graph (no store_kv): median of {TIMED_RUNS} cold-L2 runs")
    sms = num_sms(torch.device("cuda"))
    for dtype in DTYPES:
        for batch_size in BATCH_SIZES:
            for context in CONTEXTS:
                q, _, _, k_cache, v_cache, meta = make_batch(
                    [context] * batch_size, [1] * batch_size, dtype
                )
                splits = choose_num_splits(batch_size, KV_HEADS, context, sms)
                args = (q, k_cache, v_cache, meta.block_tables, meta.seq_lens, HEAD_DIM**-0.5)
                ms = median_ms(graphed_decode(args, splits).replay)
                ms_one_split = median_ms(graphed_decode(args, 1).replay)
                kv_bytes = 2 * batch_size * context * KV_HEADS * HEAD_DIM * dtype.itemsize
                print(
                    f"{str(dtype):14} batch {batch_size:3}  context {context:5}  splits {splits:2}"
                    f"  {ms * 1e3:7.1f} us  KV read {kv_bytes / (ms * 1e-3) / 1e9:7.1f} GB/s"
                    f"  (1 split: {ms_one_split * 1e3:7.1f} us)"
                )


def main() -> None:
    assert torch.cuda.is_available(), "this check needs a CUDA GPU"
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    correct = check_correctness()
    graph_ok = check_cuda_graph()
    time_decode()
    print("\nALL OK" if correct and graph_ok else "\nFAILURES ABOVE")


if __name__ == "__main__":
    main()
