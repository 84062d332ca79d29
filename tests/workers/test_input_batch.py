"""Step inputs packed for one host-to-device copy."""

import numpy as np
import torch

from workers.input_batch import packed_to_device


def test_packed_segments_start_16_byte_aligned_whatever_their_sizes():
    for sizes in [(1, 2, 3), (7, 0, 5), (4, 4, 4)]:
        segments = [np.arange(n) + 10 * i for i, n in enumerate(sizes)]
        for dtype in (np.int64, np.int32):
            views = packed_to_device(segments, dtype, torch.device("cpu"))
            assert [v.tolist() for v in views] == [s.tolist() for s in segments]
            assert all(v.data_ptr() % 16 == 0 for v in views if v.numel())
            assert all(v.dtype == torch.from_numpy(np.zeros(1, dtype)).dtype for v in views)


def test_a_verify_step_is_one_decode_row_per_token_and_draft():
    from workers.input_batch import build_verify_rows
    from workers.request_state import RequestState
    from workers.sampler import SamplingSpec
    from workers.step_input import ScheduledRequest

    spec = SamplingSpec(temperature=0.0)
    states = {"a": RequestState([5, 6, 7], 2, [3, 9, 6], spec, None),  # 3 known tokens
              "b": RequestState([8, 1], 1, [4], spec, None)}
    scheduled = [ScheduledRequest("a", 2, 3, draft_token_ids=[11, 12]),
                 ScheduledRequest("b", 1, 1)]
    verify = build_verify_rows(scheduled, states, block_size=2)
    assert verify is not None
    assert verify.request_ids == ["a", "b"] and verify.drafts == [[11, 12], []]
    rows = verify.rows
    assert rows.request_ids == ["a", "a", "a", "b"]
    assert rows.input_ids.tolist() == [7, 11, 12, 1]
    assert rows.positions.tolist() == [2, 3, 4, 1]
    assert rows.seq_lens.tolist() == [3, 4, 5, 2]  # each row sees up to its own token
    assert rows.block_tables.tolist() == [[3, 9, 6], [3, 9, 6], [3, 9, 6], [4, 0, 0]]
    # a's positions 2, 3 in block 9, 4 in block 6; b's position 1 in block 4
    assert rows.slots.tolist() == [9 * 2 + 0, 9 * 2 + 1, 6 * 2 + 0, 4 * 2 + 1]


def test_a_step_without_drafts_or_with_a_prefill_chunk_is_not_a_verify_step():
    from workers.input_batch import build_verify_rows
    from workers.request_state import RequestState
    from workers.sampler import SamplingSpec
    from workers.step_input import ScheduledRequest

    spec = SamplingSpec(temperature=0.0)
    states = {"a": RequestState([5, 6, 7], 2, [3, 9], spec, None),
              "b": RequestState([8, 1, 2, 3], 4, [4, 5], spec, None)}
    drafting = ScheduledRequest("a", 2, 2, draft_token_ids=[11])
    assert build_verify_rows([ScheduledRequest("a", 2, 1)], states, 2) is None
    assert build_verify_rows([drafting, ScheduledRequest("b", 0, 4)], states, 2) is None
    assert build_verify_rows([drafting], states, 2) is not None
