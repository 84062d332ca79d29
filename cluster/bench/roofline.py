"""The physical limit of a workload, from ceilings measured in the same run.

Two ceilings: memory bandwidth (a large device-to-device copy, bytes read + written; on the
CPU a large memcpy, counted the same way) and the dense matmul rate (bf16 on a GPU, the
model's dtype on the CPU). A workload's bound is the larger of its bytes over bandwidth and
its FLOPs over the matmul rate, for an ideal engine that runs every request in one batch::

    decode step t (all live sequences):  weight bytes + KV bytes of every live context
    bytes = steps x weight bytes + sum over requests and output tokens of context x KV/token
            + KV written for every token
    flops = 2 x params x (prompt + output tokens)
"""

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Ceilings:
    bandwidth_bytes_per_s: float
    matmul_flops_per_s: float
    matmul_dtype: str


@dataclass(frozen=True)
class ModelCost:
    weight_bytes: int  # every parameter once (a tied LM head counted once)
    kv_bytes_per_token: int  # 2 x layers x kv heads x head_dim x element bytes
    num_params: int


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int,
                   warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure_bandwidth(device: torch.device, num_bytes: int | None = None,
                      repeats: int = 10) -> float:
    """Bytes read + written per second by one large copy (4 GiB on a GPU, 256 MiB on a CPU)."""
    num_bytes = num_bytes or (4 << 30 if device.type == "cuda" else 256 << 20)
    src = torch.randint(0, 127, (num_bytes,), dtype=torch.int8, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, repeats)
    return 2 * num_bytes / seconds


def measure_matmul(device: torch.device, size: int | None = None,
                   dtype: torch.dtype | None = None, repeats: int = 10) -> float:
    """FLOP/s of one dense size^3 matmul on random data (8192 bf16 on a GPU)."""
    on_gpu = device.type == "cuda"
    size = size or (8192 if on_gpu else 1024)
    dtype = dtype or (torch.bfloat16 if on_gpu else torch.float32)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    seconds = median_seconds(lambda: a @ b, device, repeats)
    return 2 * size**3 / seconds


def measure_ceilings(device: torch.device, dtype: torch.dtype | None = None) -> Ceilings:
    matmul_dtype = torch.bfloat16 if device.type == "cuda" else (dtype or torch.float32)
    return Ceilings(measure_bandwidth(device), measure_matmul(device, dtype=matmul_dtype),
                    str(matmul_dtype).removeprefix("torch."))


def model_cost(hf_config, dtype: torch.dtype, num_params: int) -> ModelCost:
    element = torch.empty((), dtype=dtype).element_size()
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads)
    kv = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim * element
    return ModelCost(num_params * element, kv, num_params)


def per_rank(cost: ModelCost, tensor_parallel_size: int, num_kv_heads: int) -> ModelCost:
    """What one of the ranks reads, against its own GPU's ceilings (the ranks read in
    parallel; the all-reduces between them are left out of the bound): 1/tp of the weights,
    and its KV heads, one replicated head where there are fewer than ranks."""
    tp = tensor_parallel_size
    local_kv_heads = max(1, num_kv_heads // tp)
    return ModelCost(cost.weight_bytes // tp,
                     cost.kv_bytes_per_token * local_kv_heads // num_kv_heads,
                     cost.num_params // tp)


def decode_step_seconds(cost: ModelCost, contexts: list[int], ceilings: Ceilings) -> float:
    """One decode step over sequences of these context lengths: read weights and all KV."""
    bytes_moved = cost.weight_bytes + sum(contexts) * cost.kv_bytes_per_token
    return bytes_moved / ceilings.bandwidth_bytes_per_s


def latency_bound(cost: ModelCost, prompt_len: int, output_len: int,
                  ceilings: Ceilings) -> dict:
    """Batch-1 decode: mean time per output token over the contexts it passes through."""
    steps = [decode_step_seconds(cost, [prompt_len + t], ceilings) for t in range(output_len)]
    tpot = sum(steps) / len(steps)
    return {"tpot_s": tpot, "tokens_per_s": 1.0 / tpot,
            "batch1_tokens_per_s_at_context_0": 1.0 / decode_step_seconds(cost, [0], ceilings)}


def workload_bound(cost: ModelCost, prompt_lens: list[int], output_lens: list[int],
                   ceilings: Ceilings) -> dict:
    """Seconds an ideal engine needs for these requests run as one batch (module docstring)."""
    steps = max(output_lens)
    kv_read_tokens = sum(o * p + o * (o - 1) // 2 for p, o in zip(prompt_lens, output_lens,
                                                                    strict=True))
    total_tokens = sum(prompt_lens) + sum(output_lens)
    bytes_moved = (steps * cost.weight_bytes + kv_read_tokens * cost.kv_bytes_per_token
                   + total_tokens * cost.kv_bytes_per_token)
    memory_s = bytes_moved / ceilings.bandwidth_bytes_per_s
    compute_s = 2 * cost.num_params * total_tokens / ceilings.matmul_flops_per_s
    seconds = max(memory_s, compute_s)
    return {"seconds": seconds, "memory_s": memory_s, "compute_s": compute_s,
            "output_tokens_per_s": sum(output_lens) / seconds, "bytes": bytes_moved}


def as_dict(ceilings: Ceilings) -> dict:
    return asdict(ceilings)


def serving_bound(cost: ModelCost, ceilings: Ceilings, input_len: int, output_len: int,
                  batch: int) -> dict:
    """The highest request rate of a load (every request ``input_len`` prompt and
    ``output_len`` output tokens) that the ceilings allow an engine decoding ``batch``
    sequences a step: a second holds the rate's prefills (FLOPs at the matmul rate, at least
    the weights read once) and its decode steps (weights and the batch's KV at the copy rate,
    at least the batch's FLOPs), each request's share of a step 1 / batch. Prefill attention's
    FLOPs are left out (under 3% of the projections' below 2,048 tokens at 1B and up)."""
    if input_len < 1 or output_len < 1 or batch < 1:
        raise ValueError("a serving bound needs input_len, output_len and batch of at least 1")
    bandwidth, flops = ceilings.bandwidth_bytes_per_s, ceilings.matmul_flops_per_s
    prefill_s = max(2 * cost.num_params * input_len / flops,
                    (cost.weight_bytes + input_len * cost.kv_bytes_per_token) / bandwidth)
    context = input_len + (output_len - 1) / 2  # a decode's mean context
    step_s = max(decode_step_seconds(cost, [round(context)] * batch, ceilings),
                 2 * cost.num_params * batch / flops)
    request_s = prefill_s + (output_len - 1) * step_s / batch
    return {"requests_per_s": 1 / request_s, "output_tokens_per_s": output_len / request_s,
            "prefill_s": prefill_s, "decode_step_s": step_s, "batch": batch,
            "input_len": input_len, "output_len": output_len}
