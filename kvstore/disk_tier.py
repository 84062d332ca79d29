"""The disk tier's bookkeeping: which blocks have files in a directory, in LRU order.

A block is on disk when every shard's file of it exists (``block_file.py`` names them). The
directory may be shared by several processes and nodes of the same model and layout: the
index is rebuilt from the files at start-up (oldest first), and a block some other process
wrote later is adopted when a lookup finds its files. Other processes may also delete files;
a load that then finds none fails and the tokens are recomputed, so a stale index costs time,
never output.

The size bound counts this process's view; each process evicts the least recently used blocks
it knows. A tier that failed (a full or broken disk) is switched off and stays off.

The files of blocks this process writes are written by its workers, off the step
(workers/disk_io.py): one evicted while its write may still be queued is not removed here,
where it may not exist yet, but handed to the workers (``take_deletes``), whose queue removes
it after the write. Removing it here would leave the file the write makes, indexed nowhere.
"""

import contextlib
import logging
import os
import time
from collections import defaultdict
from pathlib import Path

from kvstore.block_file import TEMP_SUFFIX, block_file_name, parse_block_file_name
from kvstore.block_hash import BlockHash
from kvstore.tier_index import TierIndex

log = logging.getLogger(__name__)

STALE_TEMP_SECONDS = 600.0  # a temporary file this old was left by a process that died


def check_directory(root: Path, directory: Path | None = None) -> None:
    """Makes ``directory`` (``root`` by default) and writes a file there; ValueError naming
    ``root`` when that fails, so a bad configuration stops the engine at start-up."""
    directory = directory or root
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".probe-{os.getpid()}-{time.monotonic_ns()}{TEMP_SUFFIX}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise ValueError(f"disk_kv_cache_dir '{root}' is not a writable directory "
                         f"({error.strerror or error})") from None


class DiskTier:
    def __init__(self, root: Path, layout: str, capacity: int, tp_size: int = 1) -> None:
        """``root``: the configured directory (checked writable here, or ValueError);
        the files live in ``root/layout``, apart from those of other dtypes and shapes."""
        if capacity < 1:
            raise ValueError(f"the disk tier needs room for at least 1 block, got {capacity}")
        self.root = root
        self.directory = root / layout
        self.tp_size = tp_size
        self.index: TierIndex[None] = TierIndex(capacity)
        self.enabled = True
        self.written: set[BlockHash] = set()  # indexed blocks whose file the workers write
        self.deletes: list[BlockHash] = []  # evicted ones of those, for the next step message
        self._make_directory()
        self._rebuild()

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.index

    def __len__(self) -> int:
        return len(self.index)

    def paths(self, block_hash: BlockHash) -> list[Path]:
        return [self.directory / block_file_name(block_hash, rank, self.tp_size)
                for rank in range(self.tp_size)]

    def _make_directory(self) -> None:
        check_directory(self.root, self.directory)

    def _rebuild(self) -> None:
        """Indexes the blocks whose every shard's file is there, the least recently written
        first, evicting the oldest beyond the capacity; removes stale temporary files."""
        shards: dict[BlockHash, set[int]] = defaultdict(set)
        written: dict[BlockHash, float] = {}
        now = time.time()
        with os.scandir(self.directory) as entries:
            for entry in entries:
                try:
                    mtime = entry.stat().st_mtime
                except FileNotFoundError:
                    continue  # another process removed it meanwhile
                if entry.name.endswith(TEMP_SUFFIX):
                    if now - mtime > STALE_TEMP_SECONDS:
                        Path(entry.path).unlink(missing_ok=True)
                    continue
                parsed = parse_block_file_name(entry.name)
                if parsed is None or parsed[2] != self.tp_size:
                    continue
                block_hash, rank, _ = parsed
                shards[block_hash].add(rank)
                written[block_hash] = max(written.get(block_hash, 0.0), mtime)
        complete = [h for h, ranks in shards.items() if len(ranks) == self.tp_size]
        for block_hash in sorted(complete, key=lambda h: written[h]):
            self._make_room()
            self.index.add(block_hash, None)

    def lookup(self, block_hash: BlockHash) -> bool:
        """Whether the block is on disk; one another process wrote since is adopted."""
        if not self.enabled:
            return False
        if block_hash in self.index:
            self.index.touch(block_hash)
            return True
        if not all(path.exists() for path in self.paths(block_hash)):
            return False
        if not self._make_room():
            return False
        self.index.add(block_hash, None)
        return True

    def add(self, block_hash: BlockHash) -> bool:
        """Makes room for a block about to be written (evicting the least recently used);
        False when the tier is off or every block is pinned. A block already there is
        touched, and False says there is nothing to write."""
        if not self.enabled:
            return False
        if block_hash in self.index:
            self.index.touch(block_hash)
            return False
        if not self._make_room():
            return False
        self.index.add(block_hash, None)
        self.written.add(block_hash)
        if block_hash in self.deletes:  # its delete would follow this write: not any more
            self.deletes.remove(block_hash)
        return True

    def take_deletes(self) -> list[BlockHash]:
        """The evicted blocks whose files the workers remove, after their queued writes."""
        deletes, self.deletes = self.deletes, []
        return deletes

    def _make_room(self) -> bool:
        while self.index.is_full:
            evicted = self.index.pop_lru()
            if evicted is None:
                return False
            self._evicted(evicted[0])
        return True

    def _evicted(self, block_hash: BlockHash) -> None:
        if block_hash in self.written:
            self.written.discard(block_hash)
            self.deletes.append(block_hash)
        else:  # found on disk, not written here: its files are there, or never will be
            self._unlink(block_hash)

    def pin(self, block_hash: BlockHash) -> None:
        self.index.pin(block_hash)

    def unpin(self, block_hash: BlockHash) -> None:
        self.index.unpin(block_hash)

    def discard(self, block_hash: BlockHash) -> None:
        """Forgets a block whose files failed to read, and removes them: no process should
        try them again."""
        if block_hash in self.index:
            self.index.remove(block_hash)
        self.written.discard(block_hash)  # its read came after its write: the file is there
        self._unlink(block_hash)

    def _unlink(self, block_hash: BlockHash) -> None:
        for path in self.paths(block_hash):
            # a failing disk leaves a file behind, which no reader trusts without its checks
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)

    def disable(self, reason: str) -> None:
        """Switches the tier off for good (its disk is full or failing); logged once."""
        if self.enabled:
            self.enabled = False
            log.warning("the disk KV tier in %s is off from now on: %s; serving goes on "
                        "without it", self.directory, reason)

    def check_integrity(self) -> None:
        self.index.check_integrity()
        assert self.written <= set(self.index.entries), "a written block left the index"
        assert not set(self.deletes) & set(self.index.entries), "an indexed block is deleted"
