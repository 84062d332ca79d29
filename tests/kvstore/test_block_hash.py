import subprocess
import sys

from kvstore.block_hash import hash_block_tokens, hash_full_blocks

SCRIPT = (
    "from kvstore.block_hash import hash_full_blocks;"
    "print(*[h.hex() for h in hash_full_blocks(list(range(10)), 4, ('m',))])"
)


def test_chain_names_the_whole_prefix():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    b = hash_block_tokens(a, [5, 6, 7, 8])
    assert b != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_full_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [a, b]


def test_extra_keys_isolate_caches():
    assert hash_block_tokens(None, [1, 2], ("model-a",)) != hash_block_tokens(
        None, [1, 2], ("model-b",)
    )


def test_extension_reuses_known_hashes():
    tokens = list(range(13))
    assert hash_full_blocks(tokens, 4, known=hash_full_blocks(tokens[:5], 4)) == (
        hash_full_blocks(tokens, 4)
    )


def test_a_block_count_bounds_the_hashes_as_a_slice_would():
    tokens = list(range(17))
    for count in range(6):  # 0..5 blocks asked; the tokens hold 4 full ones
        assert hash_full_blocks(tokens, 4, num_blocks=count) == (
            hash_full_blocks(tokens[: 4 * count], 4)
        )
    known = hash_full_blocks(tokens, 4, num_blocks=1)
    assert hash_full_blocks(tokens, 4, known=known, num_blocks=3) == hash_full_blocks(
        tokens[:12], 4)


def test_same_hashes_in_two_processes():
    here = " ".join(h.hex() for h in hash_full_blocks(list(range(10)), 4, ("m",)))
    outputs = {
        subprocess.run(
            [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
            env={"PYTHONHASHSEED": seed, "PYTHONPATH": "."},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outputs == {here}
    assert len(here.split()) == 2
