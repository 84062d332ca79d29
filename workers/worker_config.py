"""What a shard is asked to be: its model, device, dtypes, KV budget and kernels."""

from dataclasses import dataclass

import torch

from workers.attention.reference import ReferenceAttentionBackend

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class WorkerConfig:
    model_path: str
    device: str = "cpu"
    dtype: str = "auto"  # auto: float32 on the CPU, bfloat16 on a GPU
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | int8 | fp8: kvstore/kv_format.py
    attention_backend: str = "auto"  # auto | reference | triton
    cpu_kv_cache_bytes: int = 1 << 30  # KV budget on the CPU, where free memory is not probed
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 2048  # sizes the activation probe on a GPU
    max_num_seqs: int = 256  # the largest decode batch a CUDA graph is captured for
    enforce_eager: bool = False  # no CUDA graphs: every step runs eagerly
    symmetric_all_reduce: bool = True  # TP on GPUs: small sums through peer memory, not NCCL
    peer_sum_kernel: str = "push"  # the kernel of those sums: push | one_shot
    cpu_threads: int = 1  # torch threads of a CPU shard in its own actor
    gpu_fraction: float = 1.0  # the share of its GPU a shard actor asks Ray for
    cpu_shard_cpus: float = 0.25  # the CPUs a CPU shard actor asks Ray for
    seed: int = 0
    max_model_len: int | None = None  # the longest sequence; None: the model's own length
    draft_model_path: str | None = None  # speculative decoding's draft model, beside the target
    draft_method: str = "draft_model"  # draft_model, or eagle / eagle3: the path is a head
    num_speculative_tokens: int = 0  # the most drafts a row verifies (0: no speculation)
    host_kv_cache_bytes: int = 0  # this shard's host buffer for offloaded KV blocks; 0: none
    disk_kv_cache_dir: str | None = None  # block files below the host buffer (needs one)
    host_loads_in_place: bool = False  # where the device can: loads layer by layer, in place
    # the model's config as the engine read it (workers/model_config.py); None: read the folder
    model_config: dict | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.float32 if self.device == "cpu" else torch.bfloat16
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype '{self.dtype}' (choose from auto, "
                             f"{', '.join(DTYPES)})")
        return DTYPES[self.dtype]


def make_attention_backend(name: str, device: torch.device):
    if name == "auto":
        name = "triton" if device.type == "cuda" else "reference"
    if name == "reference":
        return ReferenceAttentionBackend()
    if name == "triton":
        from workers.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend '{name}' (choose from auto, reference, triton)")
