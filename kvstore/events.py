"""Events the KV manager emits as blocks enter and leave the prefix cache.

The router's prefix index consumes them to learn which replica holds which prefix.
"""

from dataclasses import dataclass

from kvstore.block_hash import BlockHash


@dataclass(frozen=True)
class BlockStored:
    block_hash: BlockHash
    parent_hash: BlockHash | None


@dataclass(frozen=True)
class BlockRemoved:
    block_hash: BlockHash


KVEvent = BlockStored | BlockRemoved
