"""Rotary cos/sin: the precomputed table gives what computing them gives, bit for bit."""

import pytest
import torch
from transformers import LlamaConfig

from workers.layers.rotary import RotaryEmbedding
from workers.worker import Worker, WorkerConfig

LLAMA3_ROPE = LlamaConfig(
    hidden_size=64, num_attention_heads=4, max_position_embeddings=4096,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    rope_theta=500000.0,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_rows_equal_computed_ones(dtype):
    rotary = RotaryEmbedding(LLAMA3_ROPE, head_dim=16)
    positions = torch.tensor([4095, 0, 17, 17, 1024, 3])
    computed = rotary(positions, dtype)
    rotary.build_table(4096, dtype, torch.device("cpu"))
    assert rotary.table is not None and rotary.table.shape == (2, 4096, 16)
    gathered = rotary(positions, dtype)
    for want, got in zip(computed, gathered, strict=True):
        assert got.dtype == dtype and got.shape == (6, 16) and got.is_contiguous()
        assert torch.equal(got, want)


def test_another_dtype_computes_instead():
    rotary = RotaryEmbedding(LLAMA3_ROPE, head_dim=16)
    rotary.build_table(8, torch.bfloat16, torch.device("cpu"))
    positions = torch.tensor([100])  # past the table: only computing can give it
    cos, sin = rotary(positions, torch.float32)
    assert cos.dtype == torch.float32
    fresh = RotaryEmbedding(LLAMA3_ROPE, head_dim=16)(positions, torch.float32)
    assert torch.equal(cos, fresh[0]) and torch.equal(sin, fresh[1])


def test_an_empty_table_is_refused():
    rotary = RotaryEmbedding(LLAMA3_ROPE, head_dim=16)
    with pytest.raises(ValueError, match="num_positions must be at least 1, got 0"):
        rotary.build_table(0, torch.float32, torch.device("cpu"))
    assert rotary.table is None


@pytest.mark.parametrize("max_model_len, num_blocks, rows", [
    (None, 8, 8 * 16),  # the cache is shorter than the model's 512 positions
    (None, 64, 512),  # the model's positions
    (40, 64, 40),  # the engine's length
    (1000, 128, 1000),  # longer than the model's, as the engine admits it
])
def test_the_worker_tables_every_position_a_step_can_take(tiny_models, max_model_len,
                                                          num_blocks, rows):
    worker = Worker(WorkerConfig(str(tiny_models["llama"]), max_model_len=max_model_len))
    worker.init_kv_cache(num_blocks)
    table = worker.model.model.rotary_emb.table
    assert table is not None and table.shape == (2, rows, 16) and table.dtype == torch.float32
