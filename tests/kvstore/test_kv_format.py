"""KV block formats (kvstore/kv_format.py): names, bytes a block takes, device checks."""

import pytest

from kvstore.kv_format import (
    FP8,
    INT8,
    KVFormat,
    check_device_supports,
    check_kv_cache_dtype,
    hash_key_of,
    kv_format,
)


def test_each_name_stands_for_its_elements_and_scales():
    assert kv_format("auto", "bfloat16") == KVFormat("auto", "bfloat16", 2)
    assert kv_format("auto", "float32") == KVFormat("auto", "float32", 4)
    assert kv_format("int8", "bfloat16") == INT8 == KVFormat("int8", "int8", 1, 127.0, True, True)
    assert kv_format("fp8", "float32") == FP8 == KVFormat("fp8", "float8_e4m3fn", 1, 448.0,
                                                          center_keys=True)
    assert not kv_format("auto", "float16").quantized and INT8.quantized and FP8.quantized
    assert (kv_format("auto", "bfloat16").scale_bytes, INT8.scale_bytes, FP8.scale_bytes) == (
        0, 2, 2)


def test_int8_rotates_keys_of_a_power_of_two_head_dim_and_says_so_in_the_hash():
    auto = kv_format("auto", "bfloat16")
    assert [INT8.rotates_keys(d) for d in (1, 64, 128, 0, 24, 80, 96)] == [True] * 3 + [False] * 4
    assert not FP8.rotates_keys(64) and not auto.rotates_keys(64)
    assert (INT8.hash_key, FP8.hash_key, auto.hash_key) == (
        "kv_cache_dtype=int8+hadamard-keys+centered-keys", "kv_cache_dtype=fp8+centered-keys",
        None)
    assert [hash_key_of(n) for n in ("auto", "int8", "fp8")] == [None, INT8.hash_key, FP8.hash_key]
    with pytest.raises(ValueError, match=r"^unknown kv_cache_dtype 'int4' \(choose from auto, "
                                         r"int8, fp8\)$"):
        hash_key_of("int4")


def test_bytes_per_block_count_the_scales():
    # SmolLM2-135M: 30 layers, 3 kv heads of 64; blocks of 16 tokens
    bf16 = kv_format("auto", "bfloat16").bytes_per_block(30, 3, 64, 16)
    int8 = INT8.bytes_per_block(30, 3, 64, 16)
    assert bf16 == 2 * 30 * 3 * 64 * 2 * 16 == 368_640
    assert int8 == FP8.bytes_per_block(30, 3, 64, 16) == 2 * 30 * 3 * (64 + 2) * 16 == 190_080
    assert bf16 / int8 >= 1.9  # 1.94; 1.88 it would be with float32 scales
    # Llama-3.1-8B: 32 layers, 8 kv heads of 128
    assert (kv_format("auto", "bfloat16").bytes_per_block(32, 8, 128, 16)
            / INT8.bytes_per_block(32, 8, 128, 16)) == pytest.approx(256 / 130)


@pytest.mark.parametrize("name", ["int4", "fp16", "INT8", ""])
def test_an_unknown_name_lists_the_choices(name):
    message = f"unknown kv_cache_dtype {name!r} (choose from auto, int8, fp8)"
    with pytest.raises(ValueError) as error:
        check_kv_cache_dtype(name)
    assert str(error.value) == message
    with pytest.raises(ValueError) as error:
        kv_format(name, "bfloat16")
    assert str(error.value) == message


def test_auto_needs_a_model_dtype_it_knows():
    with pytest.raises(ValueError) as error:
        kv_format("auto", "float64")
    assert str(error.value) == ("no KV format of model dtype 'float64' (choose from float32, "
                                "bfloat16, float16)")


def test_fp8_needs_float8_in_torch_and_an_ada_or_newer_gpu():
    for capability in (None, (8, 9), (9, 0), (10, 0)):
        check_device_supports(FP8, has_float8=True, cuda_capability=capability)
    with pytest.raises(ValueError) as error:
        check_device_supports(FP8, has_float8=True, cuda_capability=(8, 0))
    assert str(error.value) == ("kv_cache_dtype 'fp8' (e4m3) needs a GPU of compute capability "
                                "8.9 or newer; this one is 8.0: use 'int8'")
    with pytest.raises(ValueError) as error:
        check_device_supports(FP8, has_float8=False, cuda_capability=None)
    assert str(error.value) == ("kv_cache_dtype 'fp8' needs torch.float8_e4m3fn, which this "
                                "torch lacks: use 'int8' or a newer torch")
    # int8 and auto run everywhere
    check_device_supports(INT8, has_float8=False, cuda_capability=(7, 0))
    check_device_supports(kv_format("auto", "float16"), has_float8=False, cuda_capability=(7, 0))
