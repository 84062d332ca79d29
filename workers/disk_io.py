"""A shard's block-file reads and writes, on one background thread so that a step never waits
for the disk.

The step thread queues jobs and goes on; the thread does them one at a time, in the order they
were queued, so a read of a block queued after its write reads what was written. A write takes
a copy of its slot's bytes when queued (the slot may be written again by the same step), and
lands under a temporary name renamed into place (``block_file.py``): readers in any process see
the whole file or none. A read fills its host slot; the offloader copies the slot to the device
only once the read is done on every shard (``kv_offload.py``).

The queue is bounded: a step that finds it full waits for room (the disk is far behind then,
and memory for the copies is not unbounded). The first write that fails (a full or failing
disk) is kept in ``error``; the writes queued after it are dropped and the reads refused, and
the offloader reports it once so that the engine switches the tier off.
"""

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.block_file import block_file_name, read_block_file, write_block_file
from kvstore.block_hash import BlockHash

log = logging.getLogger(__name__)

MAX_QUEUED = 256  # jobs (one block file each) waiting for the thread


@dataclass
class ReadJob:
    slot: int
    done: threading.Event = field(default_factory=threading.Event)
    reason: str | None = None  # why the file was refused; None once read whole

    def wait(self) -> None:
        self.done.wait()


class DiskIO:
    def __init__(self, directory: Path, layout_tag: str, rank: int, tp_size: int,
                 max_queued: int = MAX_QUEUED) -> None:
        self.directory = directory
        self.layout_tag = layout_tag
        self.rank = rank
        self.tp_size = tp_size
        self.error: str | None = None  # the first write failure: the tier is off after it
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue(max_queued)
        self._thread = threading.Thread(target=self._run, name="kv-disk-io", daemon=True)
        self._thread.start()

    def path(self, block_hash: BlockHash) -> Path:
        return self.directory / block_file_name(block_hash, self.rank, self.tp_size)

    def write(self, block_hash: BlockHash, token_ids: tuple[int, ...], data: bytes) -> None:
        """Queues a block's file (``data``: a copy of its slot, the caller's no more)."""
        self._jobs.put(lambda: self._write(block_hash, token_ids, data))

    def delete(self, block_hash: BlockHash) -> None:
        """Queues the removal of a block's file: after any write of it queued before."""
        self._jobs.put(lambda: self._delete(block_hash))

    def read(self, block_hash: BlockHash, token_ids: tuple[int, ...], slot: int,
             into: memoryview) -> ReadJob:
        """Queues a read of a block's file into ``into`` (its host slot, which nothing else
        may touch until the job is done)."""
        job = ReadJob(slot)
        self._jobs.put(lambda: self._read(block_hash, token_ids, into, job))
        return job

    def flush(self) -> None:
        """Waits until every job queued so far is done (tests, shutdown)."""
        self._jobs.join()

    def close(self) -> None:
        """Finishes the queued jobs, then stops the thread."""
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                job()
            except Exception:  # a bug, not a disk error: logged, the thread goes on
                log.exception("a KV block file job failed")
            finally:
                self._jobs.task_done()

    def _write(self, block_hash: BlockHash, token_ids: tuple[int, ...], data: bytes) -> None:
        if self.error is not None:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_block_file(self.path(block_hash), block_hash, self.layout_tag, token_ids,
                             memoryview(data))
        except OSError as failure:
            self.error = f"writing a block file failed ({failure.strerror or failure})"

    def _delete(self, block_hash: BlockHash) -> None:
        try:
            self.path(block_hash).unlink(missing_ok=True)
        except OSError as failure:  # a file left behind: no reader trusts one unchecked
            log.warning("KV block file %s could not be removed (%s)", self.path(block_hash),
                        failure.strerror or failure)

    def _read(self, block_hash: BlockHash, token_ids: tuple[int, ...], into: memoryview,
              job: ReadJob) -> None:
        job.reason = "not read"  # until the read below says otherwise
        try:
            if self.error is not None:
                job.reason = "the disk tier is off"
                return
            path = self.path(block_hash)
            job.reason = read_block_file(path, block_hash, self.layout_tag, token_ids, into)
            if job.reason is not None:
                log.warning("KV block file %s refused (%s): its tokens are recomputed",
                            path, job.reason)
        finally:
            job.done.set()
