"""One KV block in one file: its name, its header, and writing and reading it safely.

A block's file is named by its chained hash (and the shard it holds, under tensor
parallelism), so any process of the same model and layout finds it::

    <sha256 hex>.tp<size>r<rank>.kv

    header  magic, block hash, layout tag, token count, data length, data crc32
            the block's token ids (int64), then a crc32 of all of the above
    data    the block's bytes, every tensor of every layer (the workers' host-slot layout)

A file is written under a temporary name and renamed into place, so a reader sees a whole file
or none; a process killed mid-write leaves only a temporary file, which no reader takes for a
block. Reading checks every field and both checksums: a torn, truncated or corrupt file, or one
of another block or layout, is refused with the reason, never returned as KV.
"""

import os
import re
import struct
import uuid
import zlib
from collections.abc import Sequence
from pathlib import Path

from kvstore.block_hash import BlockHash

MAGIC = b"TANDEMKV"
LAYOUT_LEN = 16  # the layout tag: hex digits naming dtype and per-block tensor shapes
_FIXED = struct.Struct(f"<8s32s{LAYOUT_LEN}sIQI")  # magic, hash, layout, tokens, length, crc
_CRC = struct.Struct("<I")
TEMP_SUFFIX = ".tmp"
_NAME = re.compile(r"^([0-9a-f]{64})\.tp(\d+)r(\d+)\.kv$")


def block_file_name(block_hash: BlockHash, rank: int, tp_size: int) -> str:
    return f"{block_hash.hex()}.tp{tp_size}r{rank}.kv"


def parse_block_file_name(name: str) -> tuple[BlockHash, int, int] | None:
    """(block hash, rank, tp size) of a block file's name; None for any other name."""
    match = _NAME.match(name)
    if match is None:
        return None
    return bytes.fromhex(match[1]), int(match[3]), int(match[2])


def file_bytes(data_bytes: int, num_tokens: int) -> int:
    """The size of a block file holding ``data_bytes`` of KV for ``num_tokens`` tokens."""
    return _FIXED.size + 8 * num_tokens + _CRC.size + data_bytes


def header_bytes(block_hash: BlockHash, layout: str, token_ids: Sequence[int],
                 data: memoryview) -> bytes:
    fixed = _FIXED.pack(MAGIC, block_hash, layout.encode(), len(token_ids), data.nbytes,
                        zlib.crc32(data))
    tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return fixed + tokens + _CRC.pack(zlib.crc32(fixed + tokens))


def write_block_file(path: Path, block_hash: BlockHash, layout: str,
                     token_ids: Sequence[int], data: memoryview) -> None:
    """Writes atomically: a temporary file in the same directory, then a rename over ``path``.
    Raises OSError (a full or failing disk); the temporary file is removed then."""
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}{TEMP_SUFFIX}")
    try:
        with open(temp, "wb") as f:
            f.write(header_bytes(block_hash, layout, token_ids, data))
            f.write(data)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def read_block_file(path: Path, block_hash: BlockHash, layout: str,
                    token_ids: Sequence[int], into: memoryview) -> str | None:
    """Reads the block's data into ``into`` (exactly its size); None when the file is whole and
    holds this block, else why not (``into`` may then hold part of it: do not use it)."""
    try:
        with open(path, "rb") as f:
            fixed = f.read(_FIXED.size)
            if len(fixed) < _FIXED.size:
                return "truncated header"
            magic, stored_hash, stored_layout, num_tokens, length, data_crc = _FIXED.unpack(fixed)
            if magic != MAGIC:
                return "not a block file"
            if num_tokens != len(token_ids):
                return f"{num_tokens} tokens, expected {len(token_ids)}"
            tokens = f.read(8 * num_tokens)
            crc = f.read(_CRC.size)
            if len(tokens) < 8 * num_tokens or len(crc) < _CRC.size:
                return "truncated header"
            if _CRC.unpack(crc)[0] != zlib.crc32(fixed + tokens):
                return "header checksum mismatch"
            if stored_hash != block_hash:
                return "another block's file"
            if stored_layout != layout.encode():
                return "another layout's file"
            if list(struct.unpack(f"<{num_tokens}q", tokens)) != list(token_ids):
                return "another prefix's tokens"
            if length != into.nbytes:
                return f"{length} data bytes, expected {into.nbytes}"
            if f.readinto(into) != length or f.read(1):
                return "truncated or overlong data"
    except FileNotFoundError:
        return "missing"
    except OSError as error:
        return f"unreadable ({error.strerror or error})"
    if zlib.crc32(into) != data_crc:
        return "data checksum mismatch"
    return None
