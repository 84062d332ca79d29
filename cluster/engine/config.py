"""The engine's configuration: one frozen dataclass, checked when it is made.

Every option has a default and a one-line meaning (``option(...)``); docs/configuration.md's
configuration table lists the same names, defaults and meanings (a test holds them equal).
"""

from dataclasses import dataclass, field, fields
from typing import Any

from cluster import environment
from kvstore.kv_format import check_kv_cache_dtype
from workers.speculative.config import SpeculativeConfig

DEFAULT_MODEL = "smollm2-135m-instruct"
AUTO_GPU_DECODE_STEPS = 8  # tokens per host round trip; a request waits at most this many
PEER_SUM_KERNELS = ("push", "one_shot")


def option(default: Any, meaning: str, *, shown: str | None = None) -> Any:
    """A field with its meaning; ``shown`` is the default as docs/configuration.md writes it
    (for defaults worked out at run time). A callable default is a factory, called when a
    config is made."""
    metadata = {"meaning": meaning, "shown": shown}
    if callable(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class EngineConfig:
    model: str = option(DEFAULT_MODEL, "a catalog name or a HuggingFace model folder")
    dtype: str = option("auto", "`float32` on the CPU, `bfloat16` on a GPU; or `float32`, "
                        "`bfloat16`, `float16`")
    device: str = option("auto", "`cuda` when present, else `cpu`; or `cpu`, `cuda`, `cuda:N`")
    block_size: int = option(16, "tokens per KV block")
    kv_cache_dtype: str = option("auto", "how the KV cache stores K and V: `auto` (as `dtype`), "
                                 "`int8` or `fp8` (e4m3; GPUs of compute capability 8.9+), "
                                 "each with a scale per token and head, keys less each "
                                 "layer's calibrated mean (int8's also Hadamard-rotated "
                                 "where head_dim is a power of two): about twice the "
                                 "blocks of bfloat16; fp8 is the less accurate")
    num_kv_blocks: int | None = option(None, "KV blocks in all; by default as many as "
                                       "`cpu_kv_cache_gb` or `gpu_memory_utilization` allow",
                                       shown="from memory")
    max_num_batched_tokens: int = option(2048, "token budget of one step (prefill chunks + "
                                         "decodes)")
    max_num_seqs: int = option(64, "sequences running at once")
    max_model_len: int | None = option(None, "prompt + output limit (also capped by the KV "
                                       "cache)", shown="the model's")
    max_prefill_chunk: int = option(0, "at most this many prompt tokens of one sequence per "
                                    "step; 0: the whole budget")
    enable_prefix_caching: bool = option(True, "share the KV blocks of common prefixes")
    enable_chunked_prefill: bool = option(True, "prompts prefilled in chunks mixed with "
                                          "decodes; False: a prompt in one step or it waits "
                                          "(sequences then at most `max_num_batched_tokens`)")
    scheduler_delay_factor: float = option(0.0, "while others run, new prompts wait until the "
                                           "oldest has waited this many times the last step, "
                                           "so more of them prefill together (vLLM's)")
    tpot_target_ms: float = option(0.0, "a step's token budget from its measured cost: the "
                                   "most tokens (up to `max_num_batched_tokens`) a step takes "
                                   "within this time; 0: the fixed budget")
    attention_backend: str = option("auto", "`triton` on a GPU, `reference` (plain PyTorch) on "
                                    "the CPU")
    enforce_eager: bool = option(False, "no CUDA graphs for decode steps (used on a GPU with the "
                                 "Triton backend)")
    symmetric_all_reduce: bool = option(True, "tensor parallel on GPUs: sums up to 4 MiB "
                                        "(decode steps) through peer memory in one kernel (NCCL "
                                        "where a rank cannot set it up); False: NCCL for all")
    peer_sum_kernel: str = option(environment.peer_sum_kernel, "the kernel of those sums: "
                                  "`push` (one one-way trip) or `one_shot` (PyTorch's)",
                                  shown="push")
    decode_steps: int = option(0, "decode steps per call to the workers when every request "
                               "decodes; 0: auto (8 on a GPU, 1 on the CPU); 1: one a call")
    decode_lookahead: bool = option(True, "a multi-step call also runs the next call's first "
                                    "step, so the device works while the host reads tokens "
                                    "and schedules (off for `tandem serve`)")
    async_scheduling: bool | None = option(
        None, "schedule each step while the workers run the one before, whose tokens come back "
        "with the next call (one step a call; steps with drafts wait for their tokens; rows "
        "with a grammar or penalties read their last token while the forward runs); None: on a "
        "GPU (H100, W3's load at 128 clients: 1.19x the "
        "throughput of off), off on the CPU (nothing runs beside the host there: 0.87x)",
        shown="on a GPU")
    cpu_kv_cache_gb: float = option(1.0, "KV cache size on the CPU, in GiB")
    host_kv_cache_gb: float = option(0.0, "host memory for KV blocks offloaded from the device "
                                     "cache (written through as they fill, loaded back on a "
                                     "prefix miss), in GiB for all shards; 0: off")
    disk_kv_cache_dir: str | None = option(None, "a directory for KV blocks leaving the host "
                                           "tier, one file each, shareable by processes of the "
                                           "same model (needs `host_kv_cache_gb`)", shown="off")
    disk_kv_cache_gb: float = option(10.0, "size bound of the disk tier, in GiB")
    host_loads_in_place: bool = option(False, "on a GPU that can: host-tier loads read the "
                                       "pinned slots in place, layer by layer under the step "
                                       "(off: not faster than the staged loads at the 0.5B "
                                       "shape, docs/benchmarks.md)")
    gpu_memory_utilization: float = option(0.9, "share of the GPU's memory this engine "
                                           "takes for weights, activations and the KV cache")
    gpu_fraction: float = option(1.0, "share of a GPU each shard asks Ray for: 0.5 puts two "
                                 "replicas on one GPU (give each half the memory too)")
    cpu_shard_cpus: float = option(0.25, "CPUs each CPU shard asks Ray for: a quarter lets "
                                   "TP=8 fit two cores (shards mostly wait for each other)")
    tensor_parallel_size: int = option(1, "shards per replica (Ray actors; NCCL on GPUs, gloo on "
                                       "the CPU)")
    distributed_executor_backend: str = option("auto", "`ray` when tensor parallel, else `uni` "
                                               "(in-process)")
    cpu_threads: int = option(1, "torch threads of each CPU shard in its own Ray actor")
    cache_dir: str = option(lambda: str(environment.cache_dir()), "where catalog models are "
                            "pulled and converted", shown="$TANDEM_CACHE_DIR or ~/.cache/tandem")
    seed: int = option(0, "the sampler's seed for requests without their own")
    speculative_config: dict | None = option(None, "speculative decoding in vLLM's keys, e.g. "
                                             "`{\"method\": \"ngram\", "
                                             "\"num_speculative_tokens\": 4}`", shown="off")

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
            (self.host_kv_cache_gb >= 0,
             f"host_kv_cache_gb must be >= 0 (0: off), got {self.host_kv_cache_gb}"),
            (self.disk_kv_cache_gb > 0,
             f"disk_kv_cache_gb must be > 0, got {self.disk_kv_cache_gb}"),
            (self.disk_kv_cache_dir is None or self.host_kv_cache_gb > 0,
             "disk_kv_cache_dir needs host_kv_cache_gb > 0: blocks reach the disk tier through "
             "the host tier"),
            (self.disk_kv_cache_dir != "", "disk_kv_cache_dir is empty: give a directory, or "
             "None for no disk tier"),
            (self.host_kv_cache_gb == 0 or self.enable_prefix_caching,
             "host_kv_cache_gb needs enable_prefix_caching: the tiers find blocks by their "
             "prefix hashes"),
            (1 <= self.tensor_parallel_size <= 8,
             f"tensor_parallel_size must be in [1, 8], got {self.tensor_parallel_size}"),
            (self.distributed_executor_backend in ("auto", "uni", "ray"),
             "distributed_executor_backend must be 'auto', 'uni' or 'ray', "
             f"got '{self.distributed_executor_backend}'"),
            (self.tensor_parallel_size == 1 or self.distributed_executor_backend != "uni",
             "tensor_parallel_size > 1 needs distributed_executor_backend='ray'"),
            (self.peer_sum_kernel in PEER_SUM_KERNELS,
             f"peer_sum_kernel: the peer-memory sum kernel ({environment.PEER_SUM.name}) must "
             f"be one of {', '.join(PEER_SUM_KERNELS)}, got {self.peer_sum_kernel!r}"),
            (self.cpu_threads >= 1, f"cpu_threads must be at least 1, got {self.cpu_threads}"),
            (self.scheduler_delay_factor >= 0,
             f"scheduler_delay_factor must be >= 0, got {self.scheduler_delay_factor}"),
            (self.tpot_target_ms >= 0,
             f"tpot_target_ms must be >= 0 (0: off), got {self.tpot_target_ms}"),
            (self.enable_chunked_prefill or not self.max_prefill_chunk,
             "max_prefill_chunk needs enable_chunked_prefill"),
            (self.enable_chunked_prefill or self.max_model_len is None
             or self.max_model_len <= self.max_num_batched_tokens,
             f"with enable_chunked_prefill=False, max_model_len ({self.max_model_len}) must be "
             f"at most max_num_batched_tokens ({self.max_num_batched_tokens}): a sequence is "
             "prefilled in one step"),
            (self.cpu_shard_cpus > 0,
             f"cpu_shard_cpus must be above 0, got {self.cpu_shard_cpus}"),
            (0 < self.gpu_fraction <= 1,
             f"gpu_fraction must be in (0, 1], got {self.gpu_fraction}"),
            (self.gpu_fraction == 1 or self.tensor_parallel_size == 1,
             "gpu_fraction < 1 needs tensor_parallel_size=1 (shards of one replica need GPUs "
             "of their own)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        check_kv_cache_dtype(self.kv_cache_dtype)  # the device's own checks run in its worker
        self.speculation  # noqa: B018 - its own checks, with their messages

    @property
    def speculation(self) -> SpeculativeConfig | None:
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_dict(self.speculative_config)

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
    def resolved_async_scheduling(self) -> bool:
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.resolved_device != "cpu"

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"


def describe_options() -> list[tuple[str, str, str]]:
    """(name, default as shown, meaning) of every option, in order."""
    rows = []
    for f in fields(EngineConfig):
        shown = f.metadata["shown"]
        if shown is None:
            shown = f.default if f.default is not None else "None"
        rows.append((f.name, str(shown), f.metadata["meaning"]))
    return rows
