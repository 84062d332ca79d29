"""How busy this machine's GPUs were during a load: NVML's utilization, sampled by nvidia-smi.

NVML's utilization is the share of its last sample period in which some kernel ran on the
GPU. Sampled every 100 ms through a load, its mean says whether the device waited for the
host: a served load whose GPU is busy 60% of the time, beside an offline run of the same
work at ~100%, loses the rest in the serving path (scheduling, the step's trip to the shard,
stream delivery), not in the kernels. No nvidia-smi (the CPU, a machine without the NVIDIA
tools): no figure.
"""

import shutil
import subprocess

SAMPLE_MS = 100
QUERY = ["--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits"]


def mean_busy(lines: list[str]) -> dict[int, float]:
    """GPU index -> mean utilization (0 to 1) of nvidia-smi's ``index, percent`` lines; lines
    that are not such a pair (a partial last line, "[N/A]") are left out."""
    samples: dict[int, list[float]] = {}
    for line in lines:
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 2 or not parts[0].isdigit() or not parts[1].isdigit():
            continue
        samples.setdefault(int(parts[0]), []).append(int(parts[1]) / 100)
    return {gpu: sum(values) / len(values) for gpu, values in sorted(samples.items())}


class GpuMeter:
    """Started with a load, read at its end (``busy``): nvidia-smi samples in between."""

    def __init__(self) -> None:
        binary = shutil.which("nvidia-smi")
        self.process = None if binary is None else subprocess.Popen(
            [binary, *QUERY, f"--loop-ms={SAMPLE_MS}"], stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True)

    def busy(self) -> dict[int, float] | None:
        """GPU index -> its mean utilization since the start; None without nvidia-smi."""
        if self.process is None:
            return None
        self.process.terminate()
        output, _ = self.process.communicate()
        return mean_busy(output.splitlines())
