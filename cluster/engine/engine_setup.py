"""What an engine is built from: its workers' config, its executor, a draft model's check."""

from pathlib import Path

from transformers import PretrainedConfig

from cluster.engine.config import EngineConfig
from cluster.engine.executor import Executor, UniExecutor
from cluster.engine.kv_tiers import host_bytes_per_shard
from workers.catalog import resolve_model
from workers.loader import load_config
from workers.worker import WorkerConfig


def worker_config(config: EngineConfig, folder: Path,
                  model_config: dict | None = None) -> WorkerConfig:
    speculation = config.speculation
    draft = None  # a draft model in the worker; placement "actor" keeps it out
    if speculation is not None and speculation.model is not None \
            and speculation.placement == "worker":
        draft = str(resolve_model(speculation.model, config.cache_dir))
    return WorkerConfig(
        model_path=str(folder), device=config.resolved_device, dtype=config.dtype,
        block_size=config.block_size, kv_cache_dtype=config.kv_cache_dtype,
        attention_backend=config.attention_backend,
        cpu_kv_cache_bytes=int(config.cpu_kv_cache_gb * (1 << 30)),
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_num_batched_tokens=config.max_num_batched_tokens, seed=config.seed,
        max_num_seqs=config.max_num_seqs, enforce_eager=config.enforce_eager,
        symmetric_all_reduce=config.symmetric_all_reduce, max_model_len=config.max_model_len,
        peer_sum_kernel=config.peer_sum_kernel, cpu_threads=config.cpu_threads,
        gpu_fraction=config.gpu_fraction, cpu_shard_cpus=config.cpu_shard_cpus,
        draft_model_path=draft,
        draft_method=speculation.method if speculation is not None and draft else "draft_model",
        num_speculative_tokens=0 if speculation is None else speculation.num_speculative_tokens,
        host_kv_cache_bytes=host_bytes_per_shard(config),
        disk_kv_cache_dir=config.disk_kv_cache_dir,
        host_loads_in_place=config.host_loads_in_place, model_config=model_config,
    )


def make_executor(config: EngineConfig, folder: Path,
                  model_config: dict | None = None) -> Executor:
    """``model_config``: the folder's config as the engine read it, handed to the shards."""
    if config.executor_backend == "ray":
        from cluster.ray.ray_executor import RayExecutor

        return RayExecutor(worker_config(config, folder, model_config),
                           config.tensor_parallel_size)
    return UniExecutor(worker_config(config, folder, model_config))


def check_draft_before_download(name: str, target: PretrainedConfig) -> None:
    """A catalog draft whose vocabulary is not the target's is refused before it is pulled
    and converted; the message names the catalog models that would pair."""
    from workers.catalog.entries import CATALOG

    entry = CATALOG.get(name)
    if entry is None or entry.vocab_size == target.vocab_size:
        return  # a folder (checked once read), or a catalog model that may pair
    pairs = [other for other in CATALOG.values() if other.vocab_size == target.vocab_size]
    hint = (f"catalog drafts for it: {', '.join(e.name for e in pairs)}" if pairs else
            "no catalog model shares its vocabulary")
    raise ValueError(f"the draft model {name!r} has a vocabulary of {entry.vocab_size} tokens, "
                     f"the target {target.vocab_size}: a draft must share the target's "
                     f"tokenizer ({hint})")


def check_draft_model(folder: Path, target: PretrainedConfig) -> None:
    """A draft must speak the target's tokens: the same vocabulary and token ids."""
    draft = load_config(folder)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.vocab_size} tokens) differs from "
                         f"the target's ({target.vocab_size}): it must share the tokenizer")
    if getattr(draft, "eos_token_id", None) != getattr(target, "eos_token_id", None):
        raise ValueError(f"the draft model's eos_token_id ({draft.eos_token_id}) differs from "
                         f"the target's ({target.eos_token_id}): it must share the tokenizer")
