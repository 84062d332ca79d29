"""The two-pass greedy kernel (workers/greedy.py) on the CPU (TRITON_INTERPRET=1): the same
tokens as torch.argmax, ties included."""

# the interpreter fixture; TRITON_INTERPRET itself is set by conftest.py
from tests.workers.triton_interpreter import interpreter_fixes  # noqa: F401, I001

import pytest  # noqa: E402
import torch  # noqa: E402

from workers.greedy import CHUNK, greedy_tokens  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_argmax_with_ties_and_masked_rows(dtype):
    logits = torch.randn((4, 2 * CHUNK + 100), generator=torch.Generator().manual_seed(0))
    logits[1, 100] = logits[1, 2 * CHUNK + 50] = 50.0  # a tie across chunks: the first wins
    logits[2, CHUNK + 1] = logits[2, CHUNK + 7] = 60.0  # a tie inside a chunk
    logits[3] = float("-inf")  # everything masked: index 0, as argmax
    logits = logits.to(dtype)
    got = greedy_tokens(logits)
    assert got.dtype == torch.int64
    assert got.tolist() == logits.argmax(dim=-1).tolist() == [got[0].item(), 100, CHUNK + 1, 0]


def test_last_partial_chunk_and_strided_rows():
    wide = torch.randn((3, 3 * CHUNK), generator=torch.Generator().manual_seed(1))
    wide[0, CHUNK + 10] = 99.0
    rows = wide[:, : CHUNK + 11]  # a view with a row stride wider than its width
    assert greedy_tokens(rows).tolist() == rows.argmax(dim=-1).tolist()
    assert greedy_tokens(rows)[0].item() == CHUNK + 10


def test_empty_batch():
    assert greedy_tokens(torch.empty(0, 10)).shape == (0,)
