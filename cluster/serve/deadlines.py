"""A request's deadline: past it, the request is aborted (its KV blocks freed) and answered
504, or, when its stream has begun, ended with an error event.

The client gives it in the ``X-Request-Timeout`` header, in seconds from arrival; the server's
``request_timeout`` (0: none) applies to requests without one and caps those with one. A
request that waited past its deadline in an overloaded queue leaves it, so it no longer delays
the requests behind it. (Ray Serve reads a header of its own, ``x-request-timeout-seconds``,
and answers it without OpenAI's error body; this one is tandem's.)
"""

import asyncio
import math
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TypeVar

from cluster.serve.openai_errors import bad_request

HEADER = "x-request-timeout"

T = TypeVar("T")


class DeadlineExceeded(Exception):
    pass


def deadline_of(header: str | None, server_timeout_s: float) -> float | None:
    """The ``time.monotonic()`` the request must end by, or None for no deadline."""
    limits = [server_timeout_s] if server_timeout_s > 0 else []
    if header is not None:
        try:
            seconds = float(header)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds > 0):
            raise bad_request(f"The X-Request-Timeout header must be a positive number of "
                              f"seconds, got {header[:40]!r}.", code="invalid_header")
        limits.append(seconds)
    return time.monotonic() + min(limits) if limits else None


async def bounded(stream: AsyncIterator[T], deadline: float | None) -> AsyncIterator[T]:
    """``stream``'s items until ``deadline``; then the stream is closed (which aborts its
    requests) and ``DeadlineExceeded`` raised."""
    async with aclosing(stream):  # type: ignore[type-var]
        while True:
            # a duration, not the loop's clock: uvloop's differs from time.monotonic()
            scope = asyncio.timeout(None if deadline is None
                                    else max(deadline - time.monotonic(), 0.0))
            try:
                async with scope:
                    item = await anext(stream)
            except StopAsyncIteration:
                return
            except TimeoutError:
                if not scope.expired():  # the stream's own error, not the deadline
                    raise
                raise DeadlineExceeded("The request did not finish within its deadline "
                                       "(X-Request-Timeout, or the server's request_timeout) "
                                       "and was stopped.") from None
            yield item
