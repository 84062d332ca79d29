"""Events the KV manager emits as blocks enter and leave a replica's tiers.

The router's prefix index consumes them to learn which replica holds which prefix. A block's
``tier`` says where: its device prefix cache, or its host tier (whose blocks a request there
loads, and which another replica can pull). The disk tier sends none: a block there is found
by the request's own lookup, never routed to.
"""

from dataclasses import dataclass

from kvstore.block_hash import BlockHash

DEVICE, HOST = "device", "host"
EVENT_TIERS = (DEVICE, HOST)


def check_tier(tier: str) -> None:
    if tier not in EVENT_TIERS:
        raise ValueError(f"unknown KV event tier {tier!r} (one of {', '.join(EVENT_TIERS)})")


@dataclass(frozen=True)
class BlockStored:
    block_hash: BlockHash
    # None for a prompt's first block, and in the host tier, which does not keep parents
    parent_hash: BlockHash | None
    tier: str = DEVICE

    def __post_init__(self) -> None:
        check_tier(self.tier)


@dataclass(frozen=True)
class BlockRemoved:
    block_hash: BlockHash
    tier: str = DEVICE

    def __post_init__(self) -> None:
        check_tier(self.tier)


KVEvent = BlockStored | BlockRemoved
