"""The engine's KV tiers: built from the configuration and the shards' host buffers, and the
bytes they move, for metrics.

The host tier has as many slots as each shard's buffer (every shard holds its share of the same
blocks in the same slots); the disk tier's size bound counts every shard's file of a block.
"""

from dataclasses import dataclass
from pathlib import Path

from cluster.engine.config import EngineConfig
from kvstore.block_file import file_bytes
from kvstore.disk_tier import DiskTier
from kvstore.host_tier import HostTier
from kvstore.tiers import WRITE_PROBE_EVERY, TierCounters, TierManager
from router.kv_pricing import TransferRates, store_pays
from workers.host_layout import OffloadInfo

GIB = 1 << 30


def host_bytes_per_shard(config: EngineConfig) -> int:
    """``host_kv_cache_gb`` is for the whole replica, split evenly over its shards."""
    return int(config.host_kv_cache_gb * GIB) // config.tensor_parallel_size


def make_tiers(config: EngineConfig, info: OffloadInfo | None) -> TierManager | None:
    if info is None:
        return None
    disk = None
    if config.disk_kv_cache_dir is not None:
        tp = config.tensor_parallel_size
        per_block = tp * file_bytes(info.block_bytes, config.block_size)
        capacity = int(config.disk_kv_cache_gb * GIB) // per_block
        if capacity < 1:
            raise ValueError(f"disk_kv_cache_gb holds no KV block: one takes {per_block} bytes")
        disk = DiskTier(Path(config.disk_kv_cache_dir), info.layout_tag, capacity, tp)
    return TierManager(HostTier(info.num_slots), disk, config.block_size)


def make_rates(info: OffloadInfo | None, tp_size: int) -> TransferRates | None:
    """The rates the shards measured at start-up (rank 0's; each shard copies its share of a
    block at once, so a whole block moves at one shard's rate times their number, and stores
    in one shard's time)."""
    if info is None or info.copy_bytes_per_s <= 0 or info.prefill_tokens_per_s <= 0:
        return None
    return TransferRates(info.prefill_tokens_per_s, info.copy_bytes_per_s * tp_size,
                         info.block_bytes * tp_size,
                         load_bytes_per_s=info.load_bytes_per_s * tp_size,
                         store_seconds_per_block=info.store_seconds_per_block)


def describe_rates(rates: TransferRates, block_size: int) -> str:
    """The start-up prices of the host tier, for the engine's log: whether its blocks are
    written through, and why."""
    load_us, recompute_us = rates.load_seconds(1) * 1e6, rates.recompute_seconds(block_size) * 1e6
    measured = (f", a step's loads {rates.load_bytes_per_s / 1e9:.1f} GB/s"
                if rates.load_bytes_per_s else "")
    store_us = rates.store_seconds(1) * 1e6
    figures = (f"a block stores in {store_us:.0f} us, loads in {load_us:.0f} us (copies "
               f"{rates.host_copy_bytes_per_s / 1e9:.1f} GB/s{measured}) and recomputes in "
               f"{recompute_us:.0f} us ({rates.prefill_tokens_per_s:,.0f} prompt tokens/s)")
    if store_pays(rates, block_size):
        return f"host KV tier: {figures}: blocks are written through"
    return (f"host KV tier: {figures}: a store and a load save too little, so blocks are not "
            f"written through (but for one request in {WRITE_PROBE_EVERY}, to measure loads "
            f"again) "
            f"while the rates stay so")


@dataclass(frozen=True)
class TierTraffic:
    """Bytes moved between the tiers since start-up, over every shard."""

    offloaded: dict[str, int]  # into a tier: host (from the device), disk (from the host)
    loaded: dict[str, int]  # out of a tier: host (to the device), disk (to the host)

    @classmethod
    def of(cls, counters: TierCounters | None, block_bytes: int) -> "TierTraffic":
        if counters is None:
            return cls({"host": 0, "disk": 0}, {"host": 0, "disk": 0})
        return cls({"host": counters.stored_to_host * block_bytes,
                    "disk": counters.written_to_disk * block_bytes},
                   {"host": counters.loaded_from_host * block_bytes,
                    "disk": counters.read_from_disk * block_bytes})
