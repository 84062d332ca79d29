"""The engine's configuration: one frozen dataclass, checked when it is made."""

from dataclasses import dataclass

DEFAULT_MODEL = "smollm2-135m-instruct"
AUTO_GPU_DECODE_STEPS = 8  # tokens per host round trip; a request waits at most this many


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL  # a catalog name or a HuggingFace folder
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto (cuda if present) | cpu | cuda | cuda:N
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from memory
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's own context length
    max_prefill_chunk: int = 0  # tokens of one prompt per step at most; 0: the whole budget
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # auto | reference | triton
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    # tensor parallel on GPUs: small all-reduces (decode steps) through peer memory over NVLink
    # in one kernel; False: NCCL does every sum
    symmetric_all_reduce: bool = True
    # decode steps one call to the workers may run back to back when every request decodes
    # (no host round trip between them); 0: auto, 8 on a GPU and 1 on the CPU
    decode_steps: int = 0
    # multi-step calls also run the next call's first step while the host reads this call's
    # tokens and schedules the next (router/scheduler.py): the device does not wait for the host
    decode_lookahead: bool = True
    cpu_kv_cache_gb: float = 1.0
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "auto"  # auto (ray when tensor parallel) | uni | ray
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.block_size >= 1, f"block_size must be at least 1, got {self.block_size}"),
            (self.num_kv_blocks is None or self.num_kv_blocks >= 1,
             f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}"),
            (self.max_num_batched_tokens >= 1,
             f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}"),
            (self.max_num_seqs >= 1, f"max_num_seqs must be at least 1, got {self.max_num_seqs}"),
            (self.max_model_len is None or self.max_model_len >= 2,
             f"max_model_len must be at least 2, got {self.max_model_len}"),
            (self.max_prefill_chunk >= 0,
             f"max_prefill_chunk must be >= 0, got {self.max_prefill_chunk}"),
            (0 <= self.decode_steps <= 64,
             f"decode_steps must be in [0, 64] (0: auto), got {self.decode_steps}"),
            (0 < self.gpu_memory_utilization <= 1,
             f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"),
            (self.cpu_kv_cache_gb > 0, f"cpu_kv_cache_gb must be > 0, got {self.cpu_kv_cache_gb}"),
            (1 <= self.tensor_parallel_size <= 8,
             f"tensor_parallel_size must be in [1, 8], got {self.tensor_parallel_size}"),
            (self.distributed_executor_backend in ("auto", "uni", "ray"),
             "distributed_executor_backend must be 'auto', 'uni' or 'ray', "
             f"got '{self.distributed_executor_backend}'"),
            (self.tensor_parallel_size == 1 or self.distributed_executor_backend != "uni",
             "tensor_parallel_size > 1 needs distributed_executor_backend='ray'"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend != "auto":
            return self.distributed_executor_backend
        return "ray" if self.tensor_parallel_size > 1 else "uni"

    @property
    def resolved_decode_steps(self) -> int:
        if self.decode_steps:
            return self.decode_steps
        return 1 if self.resolved_device == "cpu" else AUTO_GPU_DECODE_STEPS

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
