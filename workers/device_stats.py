"""What one shard's GPU is doing, for /metrics: utilization and memory, read from the device.

None on the CPU: there is no device to read, and /metrics then has no GPU samples at all
(rather than zeros that would read as an idle GPU).
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DeviceStats:
    rank: int  # the shard's tensor-parallel rank in its replica
    utilization: float | None  # 0 to 1: time a kernel ran in NVML's last sample; None: no NVML
    memory_used_bytes: int  # on the whole device, every process's (what nvidia-smi shows)
    memory_total_bytes: int
    memory_reserved_bytes: int  # this shard's PyTorch allocator: weights, KV cache, activations


def read_device_stats(device: "torch.device", rank: int) -> DeviceStats | None:
    import torch  # here: DeviceStats is read where torch is not loaded (the monitor actor)

    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    try:
        # NVML (the nvidia-ml-py package) maps the device through CUDA_VISIBLE_DEVICES
        utilization: float | None = torch.cuda.utilization(device) / 100
    except Exception:  # no NVML library or package on this node: memory is still known
        utilization = None
    return DeviceStats(rank, utilization, total - free, total,
                       torch.cuda.memory_reserved(device))
