"""A grammar's token bitmask applied to logits on the GPU, in place, in one launch.

The mask comes as 32-bit words (bit ``v % 32`` of word ``v // 32`` set: token v allowed), the
layout xgrammar fills. Unpacked with torch ops it takes five kernels and a (rows, vocabulary)
int32 temporary; here each program reads a block of a row's logits and the words that cover
it, and writes -inf where a bit is clear. Only the listed rows are touched (a batch whose other
rows sample freely).
"""

import torch
import triton
import triton.language as tl

BLOCK = 4096  # logits a program reads (128 words)


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr,  # (B, V), last stride 1
    words_ptr,  # (B, W) int32, a row for each logits row
    rows_ptr,  # (R,) int64: the rows to mask
    stride_logits,
    stride_words,
    V,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + r)
    inside = offs < V
    words = tl.load(words_ptr + row * stride_words + offs // 32, mask=inside, other=-1)
    refused = ((words >> (offs % 32)) & 1) == 0
    tl.store(logits_ptr + row * stride_logits + offs, float("-inf"), mask=inside & refused)


def apply_token_bitmask(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> None:
    """Sets ``logits[row, v]`` to -inf where bit v of ``words[row]`` is clear, for each row in
    ``rows``, in place. ``logits`` (B, V) with unit last stride; ``words`` (B, W) int32 with
    W * 32 >= V; ``rows`` (R,) int64; all on one device."""
    if logits.stride(1) != 1:
        raise ValueError("the bitmask kernel needs logits with a unit last stride")
    count, vocab = rows.shape[0], logits.shape[1]
    if count == 0 or vocab == 0:
        return
    _apply_bitmask_kernel[(count, triton.cdiv(vocab, BLOCK))](
        logits, words, rows, logits.stride(0), words.stride(0), vocab, BLOCK=BLOCK)
