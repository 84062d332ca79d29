"""The grammar bitmask kernel (workers/structured/mask_kernel.py) on the CPU
(TRITON_INTERPRET=1): the logits the torch unpacking gives, only the listed rows touched."""

# the interpreter fixture; TRITON_INTERPRET itself is set by conftest.py
from tests.workers.triton_interpreter import interpreter_fixes  # noqa: F401, I001

import pytest  # noqa: E402
import torch  # noqa: E402

from workers.structured.mask_kernel import BLOCK, apply_token_bitmask  # noqa: E402
from workers.structured.masks import BITS, bitmask_words  # noqa: E402


def unpacked(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """(rows, vocab) bool: token allowed, the reference unpacking."""
    shifts = torch.arange(BITS, dtype=torch.int32)
    return (((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1)[:, :vocab]) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_refused_tokens_of_the_listed_rows_go_to_minus_infinity(dtype):
    vocab = BLOCK + 1001  # two programs a row, the second partial; a partial last word
    generator = torch.Generator().manual_seed(0)
    wide = torch.randn(4, vocab + 64, generator=generator).to(dtype)
    logits = wide[:, :vocab]  # a row stride wider than the vocabulary
    words = torch.randint(-(2**31), 2**31 - 1, (4, bitmask_words(vocab)), dtype=torch.int32,
                          generator=generator)
    words[2] = -1  # every token allowed
    expected = logits.clone()
    allowed = unpacked(words, vocab)
    for row in (0, 2, 3):
        expected[row] = expected[row].masked_fill(~allowed[row], float("-inf"))
    apply_token_bitmask(logits, words, torch.tensor([0, 2, 3]))
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[0]).sum() == (~allowed[0]).sum() > 0
    assert not torch.isinf(logits[1]).any()  # not listed: untouched
    assert not torch.isinf(wide[:, vocab:]).any()  # past the vocabulary: untouched


def test_no_rows_and_bad_strides():
    logits = torch.zeros(2, 40)
    apply_token_bitmask(logits, torch.zeros(2, 2, dtype=torch.int32),
                        torch.zeros(0, dtype=torch.int64))
    assert not torch.isinf(logits).any()
    with pytest.raises(ValueError, match="unit last stride"):
        apply_token_bitmask(logits.t(), torch.zeros(40, 1, dtype=torch.int32),
                            torch.tensor([0]))
