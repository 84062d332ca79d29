"""What the model's forward waits for before each layer: the chunks of a step's host-tier
loads that go layer by layer (workers/pinned_copies.py, workers/kv_offload.py)."""

from collections.abc import Callable

import torch


class LayerGate:
    """What the model's forward waits for before each layer: the chunks of this step's
    layer-by-layer loads (``(first layer, event)`` in layer order). Each wait is the compute
    stream's on the device, and each chunk is waited for once; a copy stream is FIFO, so
    waiting for a chunk covers those before it."""

    def __init__(self, wait: Callable[[object], None] | None = None) -> None:
        self._wait = wait if wait is not None else _compute_stream_waits
        self.pending: list[tuple[int, object]] = []

    def arm(self, chunks: list[tuple[int, object]]) -> None:
        self.pending = list(chunks)

    def before_layer(self, index: int) -> None:
        """Layer ``index`` reads and writes the cache next: its chunk has landed."""
        if not self.pending or self.pending[0][0] > index:
            return
        last = None
        while self.pending and self.pending[0][0] <= index:
            last = self.pending.pop(0)[1]
        self._wait(last)

    def wait_all(self) -> None:
        """Everything armed (before a forward that doesn't wait layer by layer: a CUDA
        graph's replay; and after the step, whatever its forward did)."""
        if self.pending:
            last = self.pending[-1][1]
            self.pending = []
            self._wait(last)


def _compute_stream_waits(event: object) -> None:
    if event is not None:
        torch.cuda.current_stream().wait_event(event)  # type: ignore[arg-type]
