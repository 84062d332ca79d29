"""Chained, stable block hashes.

A full block of ``block_size`` tokens is named by
``sha256(parent_hash || token ids as little-endian int64 || extra keys as JSON)``.
The chain makes a block's hash name its whole prefix, so equal hashes mean equal prefixes;
the fixed encoding makes the hash identical in every process and node (Python's ``hash()`` is
salted per process and never used here). Extra keys isolate caches that must not share KV:
the model id, a per-request cache salt.
"""

import functools
import hashlib
import json
import struct
from collections.abc import Sequence

BlockHash = bytes  # a 32-byte sha256 digest

ROOT_PARENT: BlockHash = bytes(32)  # the parent of a sequence's first block

ExtraKeys = tuple[str | int, ...]


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: ExtraKeys = ()
) -> BlockHash:
    digest = hashlib.sha256(parent or ROOT_PARENT)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        digest.update(_encode_extra_keys(extra_keys))
    return digest.digest()


@functools.lru_cache(maxsize=1024)
def _encode_extra_keys(extra_keys: ExtraKeys) -> bytes:
    """The extra keys' JSON, encoded once: the same few (model, salt) name every block."""
    return json.dumps(list(extra_keys)).encode()


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: ExtraKeys = (),
    known: Sequence[BlockHash] = (),
    num_blocks: int | None = None,
) -> list[BlockHash]:
    """Hashes of the first ``num_blocks`` full blocks of token_ids (every full block by
    default), extending the already computed ``known``. Bounded by a count rather than a
    slice, so a long context is not copied each time one more of its blocks fills."""
    hashes = list(known)
    parent = hashes[-1] if hashes else None
    end = len(token_ids) if num_blocks is None else min(len(token_ids), num_blocks * block_size)
    for start in range(len(hashes) * block_size, end - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes
