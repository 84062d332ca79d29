"""Turns the scheduled sequences of one step into the flat tensors the model runs on."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.attention.metadata import AttentionMetadata
from workers.request_state import RequestState
from workers.step_input import ScheduledRequest


@dataclass
class InputBatch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    meta: AttentionMetadata
    sample_request_ids: list[str]  # sequences that reach their last token and sample
    sample_indices: torch.Tensor  # (S,) row of each one's last token in the flat batch


def build_input_batch(
    scheduled: Sequence[ScheduledRequest],
    states: dict[str, RequestState],
    block_size: int,
    device: torch.device,
) -> InputBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    sample_ids: list[str] = []
    sample_rows: list[int] = []
    for item in scheduled:
        state = states[item.request_id]
        start, end = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
        input_ids += state.token_ids[start:end]
        positions += range(start, end)
        slots += [state.block_ids[p // block_size] * block_size + p % block_size
                  for p in range(start, end)]
        query_lens.append(item.num_new_tokens)
        seq_lens.append(end)
        if end == len(state.token_ids):  # caught up: the last token's logits are sampled
            sample_ids.append(item.request_id)
            sample_rows.append(len(input_ids) - 1)
    max_blocks = max(len(states[item.request_id].block_ids) for item in scheduled)
    block_tables = [states[item.request_id].block_ids + [0] * (
        max_blocks - len(states[item.request_id].block_ids)) for item in scheduled]
    query_start_loc = [0]
    for q_len in query_lens:
        query_start_loc.append(query_start_loc[-1] + q_len)

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=tensor(slots, torch.int64),
        query_start_loc=tensor(query_start_loc, torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        block_tables=tensor(block_tables, torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    return InputBatch(
        tensor(input_ids, torch.int64), tensor(positions, torch.int64), meta,
        sample_ids, tensor(sample_rows, torch.int64),
    )
