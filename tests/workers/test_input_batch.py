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
