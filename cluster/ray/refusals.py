"""Why the cluster could not take a request now: each becomes a 503 with ``Retry-After``.

Their messages are written for the client (they name nothing of the server's insides), so the
HTTP layer sends them as they are; the cause, when there is one, goes to the log.
"""


class Unavailable(RuntimeError):
    code = "unavailable"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Overloaded(Unavailable):
    """Every replica's queue is full (router/admission.py)."""

    code = "overloaded"


class Draining(Unavailable):
    """The server is shutting down: it finishes what it has and takes nothing new."""

    code = "draining"


class NoReplicaAvailable(Unavailable):
    """The request's replica was lost and no other took its continuation in time."""

    code = "no_replica_available"
