"""Programmatic dependent launch (Hopper and later) for a one-token decode step's kernels.

An experiment, off unless ``TANDEM_PDL_PREFETCH_CHUNKS`` is set (to how many chunks of its
weights a projection pulls into L2 before it waits). At batch 1 a layer is a chain of short
kernels, each ~3 µs of which a good part is the gap to the previous one and the ramp up to
bandwidth. Launched as a programmatic dependent, a kernel's programs start while the kernel
before is still running: they let the next kernel launch too, fetch what depends on no kernel
(a projection's weights), and only then wait — ``gdc_wait`` returns once the kernel before has
finished and its writes are visible. Nothing is written before the wait, and every kernel of
the chain waits before it finishes, so each still sees all earlier kernels' results.

Measure before turning it on: ``python -m workers.layers.tune_gemv --pdl`` (the projections
alone), then W1 with and without the variable.
"""

import functools
import os

import triton
import triton.language as tl

ENV = "TANDEM_PDL_PREFETCH_CHUNKS"


@functools.cache
def prefetch_chunks() -> int | None:
    """The variable's value: None (off), or the weight chunks a projection prefetches."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{ENV} must be a number of chunks (0 or more), got {value!r}")
    return int(value)


def launch_options(chunks: int | None = None, block_k: int | None = None) -> dict:
    """Keyword arguments for a kernel launch: PDL on with ``chunks`` (None: the environment's
    setting), or nothing at all. A projection gives its ``block_k``; other kernels prefetch
    nothing."""
    chunks = prefetch_chunks() if chunks is None else chunks
    if chunks is None:
        return {}
    options: dict = dict(PDL=True, launch_pdl=True)
    if block_k is not None:  # one prefetch per 64 elements: a 128-byte line of bf16
        options |= dict(PREFETCH_CHUNKS=chunks, PREFETCH_STEP=min(64, block_k))
    return options


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """With PDL: let the next kernel launch, then wait for the kernel before."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_rows_then_wait(
    w_rows, row_mask, pair_offset, K, PAIRED: tl.constexpr, PREFETCH_CHUNKS: tl.constexpr,
    BLOCK_K: tl.constexpr, STEP: tl.constexpr,
):  # fmt: skip
    """With PDL, for a projection: let the next kernel launch, pull the first chunks of this
    program's weight rows (and their pairs) into L2, then wait for the kernel before. One
    prefetch per STEP elements; an asm statement, so the compiler cannot drop it as an unused
    load."""
    tl.extra.cuda.gdc_launch_dependents()
    for chunk in tl.static_range(PREFETCH_CHUNKS):
        offs = chunk * BLOCK_K + tl.arange(0, BLOCK_K // STEP) * STEP
        mask = row_mask[:, None] & (offs < K)[None, :]
        lines = tl.where(mask, w_rows + offs[None, :], w_rows)  # masked: the row's first line
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [lines],
                                  dtype=tl.int32, is_pure=False, pack=1)
        if PAIRED:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                      [lines + pair_offset], dtype=tl.int32, is_pure=False,
                                      pack=1)
    tl.extra.cuda.gdc_wait()
