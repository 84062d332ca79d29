"""Compiles every Triton kernel of tandem for the H100/H200 (sm_90) on a machine without a GPU.

The CPU tests run the kernels under TRITON_INTERPRET, which executes them as numpy and never
builds them, so an error that only the compiler sees (a loop variable whose shape changes, a
type the GPU does not have) would first show on a GPU machine. Here every kernel goes through
Triton's whole pipeline down to a cubin, called exactly as the Python wrappers call it — their
argument types, constexprs, warps and stages — at the shapes of the models we serve: each
wrapper runs on CPU tensors, and the launch is replaced by a compile.

    python -m tools.kernels.compile_check      (must run without TRITON_INTERPRET)
"""

import functools
import inspect
import multiprocessing
import os
import sys
from collections.abc import Callable

import torch

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("tools.kernels.compile_check compiles kernels: run it without TRITON_INTERPRET=1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200
TYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
              torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8",
              torch.float8_e4m3fn: "fp8e4nv"}


def type_name(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPE_NAMES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def specialized_as_aligned(param, value: object) -> bool:
    """Whether Triton's launcher tells the compiler this argument is a multiple of 16 (pointers
    to 16-byte aligned data, integers divisible by 16), as it does at run time: the compiled
    code then vectorizes loads, so the check compiles what the GPU runs."""
    if param.do_not_specialize or getattr(param, "do_not_specialize_on_alignment", False):
        return False
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


class Compiler:
    """Stands in for JITFunction.run: records each distinct launch once, launches nothing;
    ``compile_all`` then compiles them, on every core (a cold Triton cache takes ~90 s on
    two)."""

    def __init__(self) -> None:
        self.done: dict[tuple, str] = {}
        self.pending: list[tuple] = []  # (kernel, signature, constexprs, attrs, options)

    def run(self, kernel: JITFunction, *args, grid, warmup, **kwargs) -> None:
        launch = ("num_warps", "num_stages")
        options = {key: kwargs.pop(key) for key in launch if key in kwargs}
        bound = inspect.signature(kernel.fn).bind(*args, **kwargs)
        bound.apply_defaults()
        signature, constexprs, attrs = {}, {}, {}
        for index, param in enumerate(kernel.params):
            value = bound.arguments[param.name]
            if param.is_constexpr or value is None:
                signature[param.name], constexprs[param.name] = "constexpr", value
            else:
                signature[param.name] = type_name(value)
                if specialized_as_aligned(param, value):
                    attrs[(index,)] = [["tt.divisibility", 16]]
        key = (kernel.__name__, tuple(signature.items()), tuple(constexprs.items()),
               tuple(options.items()), tuple(attrs))
        if key not in self.done:
            self.pending.append((kernel, signature, constexprs, attrs, options))
            pointers = sorted({t for t in signature.values() if t.startswith("*")})
            self.done[key] = f"{kernel.__name__} {','.join(pointers)} {constexprs} {options}"


    def compile_all(self) -> None:
        # forked workers inherit the launches (kernels do not pickle); each compiles some
        LAUNCHES[:] = self.pending
        with multiprocessing.get_context("fork").Pool(os.cpu_count()) as pool:
            errors = pool.map(compile_one, range(len(LAUNCHES)))
        failed = [error for error in errors if error is not None]
        if failed:
            raise SystemExit("\n".join(failed))


LAUNCHES: list[tuple] = []  # Compiler.pending, as the forked workers find it


def compile_one(index: int) -> str | None:
    kernel, signature, constexprs, attrs, options = LAUNCHES[index]
    try:
        triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET,
                       options=options)
    except Exception as error:
        return f"{kernel.__name__} {constexprs}: {type(error).__name__}: {error}"
    return None


def call(what: str, wrapper: Callable, *args, **kwargs) -> None:
    try:
        wrapper(*args, **kwargs)
    except Exception as error:
        raise SystemExit(f"{what}: {type(error).__name__}: {error}") from error


def compile_all() -> None:
    """Each kernel's wrapper called as the models call it."""
    from workers.greedy import greedy_tokens
    from workers.layers.attention_input import attention_input
    from workers.layers.fused_kernels import add_rms_norm, rms_norm, silu_and_mul
    from workers.layers.gemv import gemv, qkv_rotary_store

    # (hidden, heads, kv heads, head_dim, intermediate): Llama-3.2-1B, Qwen3-0.6B, 8B at TP 2
    shapes = [(2048, 32, 8, 64, 8192), (1024, 16, 8, 128, 3072), (4096, 16, 4, 128, 7168)]
    # every shape in bfloat16; the other dtypes' kernels differ only in types, one shape each
    cases = [(torch.bfloat16, shape) for shape in shapes]
    cases += [(torch.float16, shapes[0]), (torch.float32, shapes[0])]
    for dtype, (hidden, heads, kv_heads, head_dim, inter) in cases:
        zeros = functools.partial(torch.zeros, dtype=dtype)  # zeros(*shape) in this dtype

        x, res, norm = zeros(1, hidden), zeros(1, hidden), zeros(hidden)
        qkv_w = zeros((heads + 2 * kv_heads) * head_dim, hidden)
        call("gemv qkv + norm", gemv, x, qkv_w, residual=res, norm_weight=norm)
        call("gemv qkv + norm, first layer", gemv, x, qkv_w, norm_weight=norm)
        call("gemv qkv + bias", gemv, x, qkv_w, zeros(len(qkv_w)), residual=res,
             norm_weight=norm)
        call("gemv o", gemv, zeros(1, heads * head_dim), zeros(hidden, heads * head_dim))
        call("gemv gate_up", gemv, x, zeros(2 * inter, hidden), residual=res, norm_weight=norm,
             silu_mul=True)
        call("gemv down", gemv, zeros(1, inter), zeros(hidden, inter))
        cache = zeros(8, 16, kv_heads, head_dim)
        rotary_args = (zeros(1, head_dim), zeros(1, head_dim), cache, cache,
                       torch.zeros(1, dtype=torch.int64), heads)
        call("qkv + rotary + store", qkv_rotary_store, x, qkv_w, None, res, norm, 1e-5,
             *rotary_args)
        call("qkv + rotary + store, first layer, bias", qkv_rotary_store, x, qkv_w,
             zeros(len(qkv_w)), None, norm, 1e-5, *rotary_args)
        h, qkv = zeros(64, hidden), zeros(64, heads + 2 * kv_heads, head_dim)
        call("rms_norm", rms_norm, h, norm, 1e-5)
        call("add_rms_norm", add_rms_norm, h, h, norm, 1e-5)
        cache = zeros(8, 16, kv_heads, head_dim)
        slots = torch.zeros(64, dtype=torch.int64)
        call("attention input", attention_input, qkv.flatten(1), heads, zeros(64, head_dim),
             zeros(64, head_dim), cache, cache, slots)
        call("attention input, per-head norms", attention_input, qkv.flatten(1), heads,
             zeros(64, head_dim), zeros(64, head_dim), cache, cache, slots, norm[:head_dim],
             norm[:head_dim], eps=1e-6)
        call("attention input, row scale", attention_input, qkv.flatten(1), heads,
             zeros(64, head_dim), zeros(64, head_dim), cache, cache, slots, row_scale=(h, 1e-6))
        call("attention input, per-head norms, row scale", attention_input, qkv.flatten(1),
             heads, zeros(64, head_dim), zeros(64, head_dim), cache, cache, slots,
             norm[:head_dim], norm[:head_dim], eps=1e-6, row_scale=(h, 1e-6))
        call("silu_and_mul", silu_and_mul, zeros(64, 2 * inter))
        call("silu_and_mul, row scale", silu_and_mul, zeros(64, 2 * inter), row_scale=(h, 1e-6))
        compile_attention(zeros, heads, kv_heads, head_dim)
    for hidden, heads, kv_heads, head_dim, _ in shapes[:2]:  # head_dim 64 and 128
        for element in (torch.int8, torch.float8_e4m3fn):
            compile_quantized_kv(torch.bfloat16, element, hidden, heads, kv_heads, head_dim)
    for vocab in (128256, 151936):  # Llama 3's and Qwen3's; the sampler's logits are float32
        call("greedy tokens", greedy_tokens, torch.zeros(1, vocab))
    compile_push_all_reduce()
    compile_pinned_copies()


def compile_pinned_copies() -> None:
    """The host tier's in-place loads at a 0.5B and an 8B cache's block (one and several word
    blocks a layer's share) and an int8 cache with its scales."""
    from workers.attention.layer_cache import LayerKVCache
    from workers.block_copies import BlockCopies
    from workers.host_layout import BlockLayout, layer_tensors
    from workers.pinned_copies import PinnedCopies

    index = torch.zeros(4, dtype=torch.int64)
    for kv_heads, head_dim, scales in ((2, 64, False), (8, 128, False), (2, 64, True)):
        element = torch.int8 if scales else torch.bfloat16
        k, v = (torch.zeros(4, 8, 16, kv_heads, head_dim, dtype=element) for _ in range(2))
        ks, vs = (torch.zeros(4, 8, 16, kv_heads, dtype=torch.float16) for _ in range(2))
        caches = [LayerKVCache(k[i], v[i], ks[i] if scales else None, vs[i] if scales else None)
                  for i in range(4)]
        tensors = layer_tensors(caches)
        layout = BlockLayout.of(tensors, 1)
        host = torch.zeros(8, layout.block_bytes, dtype=torch.uint8)
        copies = PinnedCopies(host, BlockCopies(tensors, layout), 4, len(tensors))
        call("pinned load", copies.load, index, index, 0, 2)


def compile_push_all_reduce() -> None:
    from workers.layers.push_all_reduce import new_counters, push_all_reduce

    uses = new_counters(torch.device("cpu"))
    for world in (2, 4, 8):  # every rank compiles its own variant: rank 0 and the last
        ptrs = torch.zeros(world, dtype=torch.int64)
        for rank in (0, world - 1):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                call(f"push all-reduce, rank {rank} of {world}", push_all_reduce,
                     torch.zeros(1, 4096, dtype=dtype), ptrs, uses, rank, 1 << 20)


def compile_attention(zeros: Callable, heads: int, kv_heads: int, head_dim: int) -> None:
    from workers.attention.triton_decode import decode_attention
    from workers.attention.triton_prefill import extend_attention
    from workers.attention.triton_store import store_kv

    batch, num_blocks, block_size = 4, 64, 16
    cache, kv = zeros(num_blocks, block_size, kv_heads, head_dim), zeros(batch, kv_heads, head_dim)
    q = zeros(batch, heads, head_dim)
    tables = torch.zeros(batch, 16, dtype=torch.int32)
    lens = torch.full((batch,), 100, dtype=torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    call("store_kv", store_kv, kv, kv, cache, cache, torch.arange(batch))
    call("extend attention", extend_attention, q, cache, cache, starts, lens, tables, 1, 0.1)
    order = torch.arange(batch, dtype=torch.int32)
    for splits in (1, 2):  # one split and several take different tiles (default_tile)
        call(f"decode attention, {splits} split(s)", decode_attention, q, cache, cache, tables,
             lens, 0.1, splits)
        call(f"decode attention, {splits} split(s), rows in order", decode_attention, q, cache,
             cache, tables, lens, 0.1, splits, order=order)


def compile_quantized_kv(dtype: torch.dtype, element: torch.dtype, hidden: int, heads: int,
                         kv_heads: int, head_dim: int) -> None:
    """The kernels that write or read a quantized cache: int8 or e4m3 elements, float16 scales
    (workers/attention/kv_quant.py)."""
    from workers.attention.triton_decode import decode_attention
    from workers.attention.triton_prefill import extend_attention
    from workers.attention.triton_store import store_kv
    from workers.layers.attention_input import attention_input

    batch, num_blocks, block_size = 4, 64, 16
    cache = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=element)
    scales = {"k_scale": torch.zeros(num_blocks, block_size, kv_heads, dtype=torch.float16),
              "v_scale": torch.zeros(num_blocks, block_size, kv_heads, dtype=torch.float16)}
    q, kv = torch.zeros(batch, heads, head_dim, dtype=dtype), torch.zeros(batch, kv_heads,
                                                                           head_dim, dtype=dtype)
    tables = torch.zeros(batch, 16, dtype=torch.int32)
    lens = torch.full((batch,), 100, dtype=torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    what = f"{element} cache"
    call(f"store_kv, {what}", store_kv, kv, kv, cache, cache, torch.arange(batch), **scales)
    call(f"extend attention, {what}", extend_attention, q, cache, cache, starts, lens, tables,
         1, 0.1, **scales)
    for splits in (1, 2):
        call(f"decode attention, {splits} split(s), {what}", decode_attention, q, cache, cache,
             tables, lens, 0.1, splits, **scales)
    qkv, rows = torch.zeros(64, (heads + 2 * kv_heads) * head_dim, dtype=dtype), torch.zeros(
        64, head_dim, dtype=dtype)
    slots, norm = torch.zeros(64, dtype=torch.int64), torch.zeros(head_dim, dtype=dtype)
    call(f"attention input, {what}", attention_input, qkv, heads, rows, rows, cache, cache,
         slots, **scales)
    call(f"attention input, per-head norms, row scale, {what}", attention_input, qkv, heads,
         rows, rows, cache, cache, slots, norm, norm, eps=1e-6,
         row_scale=(torch.zeros(64, hidden, dtype=dtype), 1e-6), **scales)
    call(f"attention input, centered keys, {what}", attention_input, qkv, heads, rows, rows,
         cache, cache, slots, key_center=torch.zeros(kv_heads, head_dim, dtype=dtype), **scales)
    call(f"attention input, centered and rotated keys, {what}", attention_input, qkv, heads,
         rows, rows, cache, cache, slots, key_center=torch.zeros(kv_heads, head_dim, dtype=dtype),
         rotate=True, **scales)


def main() -> None:
    compiler = Compiler()
    original = JITFunction.run
    JITFunction.run = lambda self, *a, **k: compiler.run(self, *a, **k)  # type: ignore[method-assign]
    try:
        compile_all()
    finally:
        JITFunction.run = original  # type: ignore[method-assign]
    compiler.compile_all()
    for line in sorted(compiler.done.values()):
        print(line)
    print(f"{len(compiler.done)} kernel variants compiled for sm_90")


if __name__ == "__main__":
    main()
