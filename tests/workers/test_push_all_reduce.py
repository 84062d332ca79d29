"""The push all-reduce kernel (workers/layers/push_all_reduce.py) on the CPU: one process per
rank runs the kernel under TRITON_INTERPRET=1 over buffers in shared memory, which every
process maps as GPUs map their peers' buffers; the flags and slots are real, so a rank that
read a slot before its peer's flag was up, or a slot its peer was still to write, gets a wrong
sum here too."""

import pytest
import torch
import torch.multiprocessing as mp

from workers.layers import push_all_reduce as push

SLOT_BYTES = 1 << 16
# one program, several programs, several chunks a program (more than MAX_PROGRAMS * BLOCK
# elements would need bigger slots), a masked tail, and a size seen again
SIZES = [4096, 100, 5000, 4096, 3 * push.BLOCK + 7]


def rank_input(rank: int, call: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(numel, generator=generator).to(dtype)


def _run_rank(rank, buffers, counters, results, dtype, max_spins):  # noqa: ANN001
    from tests.workers.triton_interpreter import patched_interpreter

    push.MAX_SPINS = max_spins
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
    with patched_interpreter():
        for call, numel in enumerate(SIZES):
            out = push.push_all_reduce(rank_input(rank, call, numel, dtype), ptrs,
                                       counters[rank], rank, SLOT_BYTES)
            results[rank][call, :numel] = out.float()


def run_ranks(world: int, dtype: torch.dtype, first_use: int = 0, ranks: int | None = None,
              max_spins: int = push.MAX_SPINS):
    """Every size of SIZES summed by ``ranks`` of ``world`` processes (all by default);
    returns each rank's results and counters."""
    buffers = [torch.zeros(push.buffer_bytes(world, SLOT_BYTES), dtype=torch.uint8).share_memory_()
               for _ in range(world)]
    counters = [push.new_counters(torch.device("cpu")).share_memory_() for _ in range(world)]
    for c in counters:
        c[:-1] = first_use
    results = [torch.zeros(len(SIZES), max(SIZES)).share_memory_() for _ in range(world)]
    mp.start_processes(_run_rank, args=(buffers, counters, results, dtype, max_spins),
                       nprocs=ranks or world, start_method="spawn")
    return results, counters


def expected_sums(world: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [sum(rank_input(r, call, n, dtype).float() for r in range(world))
            for call, n in enumerate(SIZES)]


@pytest.mark.parametrize("world", [2, 3])
def test_float32_sums_are_exact_on_every_rank(world):
    results, counters = run_ranks(world, torch.float32)
    for call, expected in enumerate(expected_sums(world, torch.float32)):
        n = len(expected)
        for rank in range(world):
            assert torch.equal(results[rank][call, :n], expected), (world, rank, SIZES[call])
    # program 0 ran every sum; program 4 only the one that needed five programs
    assert counters[0][:6].tolist() == [5, 4, 4, 4, 1, 0] and counters[0][-1] == 0
    assert all(torch.equal(c, counters[0]) for c in counters)


def test_bfloat16_ranks_get_the_same_bits_and_counters_wrap_around():
    """Every rank sums in rank order, so every rank holds the same bits; the flag test holds
    across the int32 counters wrapping."""
    results, counters = run_ranks(2, torch.bfloat16, first_use=2**31 - 3)
    for call, expected in enumerate(expected_sums(2, torch.bfloat16)):
        n = len(expected)
        assert torch.equal(results[0][call, :n], results[1][call, :n])
        torch.testing.assert_close(results[0][call, :n], expected, atol=0.02, rtol=0.01)
    assert counters[0][0] == -(2**31) + 2  # five uses past 2**31 - 3, wrapped
    assert counters[0][-1] == 0


def test_a_peer_that_never_comes_sets_the_error_flag_instead_of_hanging():
    results, counters = run_ranks(2, torch.float32, ranks=1, max_spins=4)
    assert counters[0][-1] == 1
    assert counters[0][:6].tolist() == [5, 4, 4, 4, 1, 0]
