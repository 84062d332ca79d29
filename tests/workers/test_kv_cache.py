"""Sizing and allocating quantized KV caches (workers/kv_cache.py): the blocks a memory budget
holds in each format, the tensors allocated for them, and the errors at start-up."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kvstore.kv_format import FP8, INT8
from workers.kv_cache import allocate_kv_caches, kv_bytes_per_block, resolve_kv_format
from workers.worker import Worker, WorkerConfig

# head_dim 64 as SmolLM2's and Llama-3.2-1B's: the smallest of the real ones, where a scale
# weighs most
HEAD_DIM_64 = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                   max_position_embeddings=256, bos_token_id=None, eos_token_id=None)
SMOLLM2 = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                      num_hidden_layers=30)


@pytest.fixture(scope="module")
def head_dim_64_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv-cache") / "head-dim-64"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**HEAD_DIM_64)).save_pretrained(folder)
    return folder


def num_blocks(folder, kv_cache_dtype: str) -> int:
    config = WorkerConfig(model_path=str(folder), dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
                          cpu_kv_cache_bytes=16 << 20)
    return Worker(config).determine_num_kv_blocks()


def test_the_pool_holds_1_9x_the_bfloat16_blocks_in_int8_or_fp8(head_dim_64_model):
    # a block of 16 tokens: 2 (K, V) x 2 layers x 1 kv head x (64 elements + 1 scale)
    bf16 = num_blocks(head_dim_64_model, "auto")
    assert bf16 == (16 << 20) // (2 * 2 * 1 * 64 * 2 * 16) == 2048
    int8 = num_blocks(head_dim_64_model, "int8")
    assert int8 == num_blocks(head_dim_64_model, "fp8") == (16 << 20) // (2 * 2 * (64 + 2) * 16)
    assert int8 == 3971 and int8 / bf16 >= 1.9


def test_bytes_per_block_of_a_real_shape_and_a_tensor_parallel_shard():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert kv_bytes_per_block(SMOLLM2, 1, 16, bf16) == 368_640
    assert kv_bytes_per_block(SMOLLM2, 1, 16, bf16, INT8) == 190_080
    assert kv_bytes_per_block(SMOLLM2, 1, 16, fp32, FP8) == 190_080  # the model dtype aside
    assert kv_bytes_per_block(SMOLLM2, 1, 16, fp32) == 2 * 368_640
    # 3 kv heads on 3 ranks: one each
    assert kv_bytes_per_block(SMOLLM2, 3, 16, bf16, INT8) == 190_080 // 3


@pytest.mark.parametrize("fmt", [None, INT8, FP8])
def test_the_allocated_tensors_take_the_bytes_the_sizing_counts(fmt):
    caches = allocate_kv_caches(SMOLLM2, 1, 5, 16, torch.bfloat16, torch.device("cpu"), fmt)
    assert len(caches) == 30
    layer = caches[0]
    assert layer.k.shape == layer.v.shape == (5, 16, 3, 64)
    assert layer.quantized == (fmt is not None)
    if fmt is None:
        assert layer.k.dtype == torch.bfloat16 and layer.k_scale is None
    else:
        assert layer.k.dtype == getattr(torch, fmt.element_dtype)
        assert layer.k_scale.shape == layer.v_scale.shape == (5, 16, 3)
        assert layer.k_scale.dtype == layer.v_scale.dtype == torch.float16
    tensors = [t for c in caches for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None]
    allocated = sum(t.numel() * t.element_size() for t in tensors)
    assert allocated == 5 * kv_bytes_per_block(SMOLLM2, 1, 16, torch.bfloat16, fmt)


def test_a_worker_refuses_an_unknown_kv_cache_dtype_at_start_up(head_dim_64_model):
    with pytest.raises(ValueError) as error:
        Worker(WorkerConfig(model_path=str(head_dim_64_model), kv_cache_dtype="int4"))
    assert str(error.value) == "unknown kv_cache_dtype 'int4' (choose from auto, int8, fp8)"


def test_the_cpu_takes_every_format():
    cpu = torch.device("cpu")
    assert resolve_kv_format("fp8", torch.float32, cpu) == FP8  # e4m3 emulated by torch
    assert resolve_kv_format("int8", torch.bfloat16, cpu) == INT8
    assert resolve_kv_format("auto", torch.float16, cpu).element_dtype == "float16"
