"""The grammar bitmask kernel compiled on a GPU: the torch unpacking's logits at the default
model's vocabulary, a batch of 64 with every other row constrained."""

import pytest
import torch

from workers.structured.masks import BITS, bitmask_words


@pytest.mark.gpu
def test_the_kernel_masks_as_torch_unpacks_on_a_gpu():
    from workers.structured.mask_kernel import apply_token_bitmask

    vocab, device = 49152, torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(64, vocab, generator=generator, device=device).to(torch.bfloat16)
    words = torch.randint(-(2**31), 2**31 - 1, (64, bitmask_words(vocab)), dtype=torch.int32,
                          generator=generator, device=device)
    rows = torch.arange(0, 64, 2, device=device)
    shifts = torch.arange(BITS, dtype=torch.int32, device=device)
    allowed = (((words.unsqueeze(-1) >> shifts) & 1).view(64, -1)[:, :vocab]) == 1
    expected = logits.clone()
    expected[rows] = expected[rows].masked_fill(~allowed[rows], float("-inf"))
    apply_token_bitmask(logits, words, rows)
    assert torch.equal(logits, expected)
