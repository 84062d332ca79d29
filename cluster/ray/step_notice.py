"""A step's end, told to the replica through a pipe, so that it sleeps while its shards work.

A compiled graph hands a step's result back through a shared-memory channel that the reader
polls: the replica process reading it (``ray.get`` in RayExecutor.execute) held a core for the
whole step, as much CPU as the shard doing the work (on the 2-core CPU, 0.88-0.90 of a core
beside the shard's 0.93 during ``tandem bench serve``). Each shard writes one byte to a FIFO
of its own as it finishes a step; the replica waits for every rank's byte in ``select`` (no
CPU), then reads the results, which are then a few microseconds away.

A shard that dies closes its end, and the replica's ``select`` wakes at once on the EOF: the
result read that follows raises the shard's failure as before. Shards on another node than
the replica have no such FIFO (``connect`` says so) and the replica polls as before.
"""

import contextlib
import os
import select
import tempfile
import time

WAIT_LIMIT_S = 5.0  # a notice this late: poll the result as before (never wait for ever here)


class StepNotices:
    """The replica's end: one FIFO a rank, opened for reading before any shard connects."""

    def __init__(self, num_ranks: int) -> None:
        self.folder = tempfile.mkdtemp(prefix="tandem-steps-")
        self.paths = [os.path.join(self.folder, f"rank{rank}") for rank in range(num_ranks)]
        self.fds: list[int] = []
        for path in self.paths:
            os.mkfifo(path, 0o600)
            # non-blocking: opening a FIFO's read end would otherwise wait for a writer
            self.fds.append(os.open(path, os.O_RDONLY | os.O_NONBLOCK))

    def wait(self, limit_s: float = WAIT_LIMIT_S) -> str:
        """Until every rank told the end of its step ("told"), or one closed its end, having
        died ("closed"), or ``limit_s`` passed ("late")."""
        waiting = set(self.fds)
        deadline = time.monotonic() + limit_s
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                return "late"
            ready, _, _ = select.select(list(waiting), [], [], left)
            for fd in ready:
                try:
                    data = os.read(fd, 4096)  # this step's byte (``drain`` left no other)
                except BlockingIOError:
                    continue
                if not data:  # EOF: the shard is gone; the result read says how
                    return "closed"
                waiting.discard(fd)
        return "told"

    def drain(self) -> None:
        """After the results are read: every byte of the step is in by then (a shard writes
        before it returns); left unread, a late one would wake the next step's wait early."""
        for fd in self.fds:
            with contextlib.suppress(BlockingIOError):
                while os.read(fd, 4096):
                    pass

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        for path in self.paths:
            with contextlib.suppress(OSError):
                os.unlink(path)
        with contextlib.suppress(OSError):
            os.rmdir(self.folder)
        self.fds = []


class StepNoticeSender:
    """A shard's end: one byte a step."""

    def __init__(self) -> None:
        self.fd: int | None = None

    def connect(self, path: str) -> bool:
        """Opens the replica's FIFO for this rank; False where it does not exist here (the
        replica is on another node) or nobody reads it."""
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return False
        return True

    def send(self) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, b"\0")
        except BlockingIOError:
            pass  # the pipe is full of notices nobody read: one more changes nothing
        except OSError:  # the replica closed its end: it reads results as before
            self.close()

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None
