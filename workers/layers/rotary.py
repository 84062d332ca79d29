"""Rotary position embedding, neox style (HF Llama's ``rotate_half``): the head is two halves.

The frequencies follow ``transformers.modeling_rope_utils`` operation for operation, in float32,
so that float32 outputs match HF bit for bit: rounding differences in cos/sin at position p grow
with p and can flip a greedy token late in a long generation.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

if TYPE_CHECKING:  # transformers is imported where a config is read, not to run a shard
    from transformers import PretrainedConfig


def rope_parameters(config: PretrainedConfig) -> dict:
    """rope_type, rope_theta and scaling numbers, from transformers 5 (``rope_parameters``) or
    4.x (``rope_theta`` plus ``rope_scaling``) configs."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (base**exponents)  # (dim/2,)


def llama3_inv_freq(params: dict, dim: int, max_positions: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    inv_freq = default_inv_freq(params["rope_theta"], dim)
    factor = params["factor"]
    low_freq_factor, high_freq_factor = params["low_freq_factor"], params["high_freq_factor"]
    old_context_len = params.get("original_max_position_embeddings", max_positions)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed_inv_freq = (
        1 - smooth_factor
    ) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def inv_freq_for(config: PretrainedConfig, head_dim: int) -> torch.Tensor:
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type == "default":
        return default_inv_freq(params["rope_theta"], head_dim)
    if rope_type == "linear":
        return default_inv_freq(params["rope_theta"], head_dim) / params["factor"]
    if rope_type == "llama3":
        return llama3_inv_freq(params, head_dim, config.max_position_embeddings)
    raise ValueError(f"unsupported rope type {rope_type!r} (supported: default, linear, llama3)")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, head_dim); cos, sin: (T, head_dim)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (T, 1, head_dim): broadcast over heads
    return (x * cos) + (rotate_half(x) * sin)


class RotaryEmbedding(nn.Module):
    """cos/sin for a step's positions, computed once a step; every layer then applies them.

    With a table (``build_table``) a step gathers its rows in one kernel instead of computing
    them in seven (float, multiply, cat, cos, sin and two casts: ~9 µs of a decode step's GPU
    time on an H200). The table holds what ``compute`` gives, bit for bit: both run the same
    elementwise operations on the same numbers, position by position."""

    def __init__(self, config: PretrainedConfig, head_dim: int):
        super().__init__()
        # computed on the CPU like HF, then moved to the device being built on. A plain
        # attribute, not a buffer: model.to(bfloat16) must not round the frequencies.
        self.inv_freq = inv_freq_for(config, head_dim).to(torch.get_default_device())
        self.table: torch.Tensor | None = None  # (2, positions, head_dim): cos, then sin

    def compute(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)  # (T, head_dim/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, head_dim)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def build_table(self, num_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        """Precomputes positions 0 .. num_positions - 1; later steps must stay below it."""
        if num_positions < 1:
            raise ValueError(f"num_positions must be at least 1, got {num_positions}")
        positions = torch.arange(num_positions, device=device)
        self.table = torch.stack(self.compute(positions, dtype))

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (T,) → cos, sin: (T, head_dim) in dtype."""
        table = self.table
        if table is None or table.dtype != dtype or table.device != positions.device:
            return self.compute(positions, dtype)
        cos, sin = table.index_select(1, positions)  # one gather for both
        return cos, sin
