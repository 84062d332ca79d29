"""Where the model's shards run. The engine sees only this interface."""

from typing import Protocol

from workers.device_stats import DeviceStats
from workers.host_layout import OffloadInfo
from workers.step_input import StepInput, StepOutput
from workers.worker import Worker, WorkerConfig


class Executor(Protocol):
    def determine_num_kv_blocks(self) -> int: ...
    def init_kv_cache(self, num_blocks: int) -> OffloadInfo | None:
        """Allocates every shard's cache (and host buffer); the host buffer's shape, if any."""
        ...
    def key_centers_digest(self) -> str | None:
        """What the shards' int8 keys are centered by, as a digest (workers/attention/
        key_centers.py); None when they are not."""
        ...
    def execute(self, step: StepInput) -> StepOutput: ...
    def device_stats(self) -> list[DeviceStats]: ...  # one per shard on a GPU, none on the CPU
    def shutdown(self) -> None: ...


class UniExecutor:
    """One worker in the engine's own process: one device, no tensor parallelism."""

    def __init__(self, config: WorkerConfig) -> None:
        self.worker = Worker(config)

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def init_kv_cache(self, num_blocks: int) -> OffloadInfo | None:
        return self.worker.init_kv_cache(num_blocks)

    def key_centers_digest(self) -> str | None:
        return self.worker.key_centers_digest()

    def execute(self, step: StepInput) -> StepOutput:
        output = self.worker.execute(step)
        assert output is not None, "the in-process worker is the driver"
        return output

    def device_stats(self) -> list[DeviceStats]:
        stats = self.worker.device_stats()
        return [stats] if stats is not None else []

    def shutdown(self) -> None:
        if self.worker.offloader is not None:
            self.worker.offloader.flush()  # the block files still queued
        self.worker.kv_caches = []
