"""How an exception becomes what the client is told.

A client hears what it did wrong (a 400 in our own words) or that the server failed (a 5xx
with a reference), never the exception's text: a Ray error's text carries a traceback, file
paths, ANSI colours, PIDs, actor ids and node addresses. That text goes to the log, under the
reference the body gives, so an operator can find it.
"""

import logging
import uuid

import ray

from cluster.engine.outputs import RequestFailed
from cluster.ray.refusals import Unavailable
from cluster.ray.replica import ReplicaFailure
from cluster.serve.deadlines import DeadlineExceeded
from cluster.serve.openai_errors import APIError, bad_request

log = logging.getLogger(__name__)

# a replica lost under a request that could not be continued: it is back in seconds (a rebuild
# or a restart), so the client may retry soon
LOST_REPLICA_RETRY_AFTER_S = 5


def as_api_error(error: BaseException, param: str | None = None) -> APIError:
    """The response for ``error``: its own status if it is one; 400 for a ValueError of ours
    (the input was refused; ``param`` names the field); otherwise a 5xx, logged in full."""
    if isinstance(error, APIError):
        return error
    cause = root_cause(error)
    if isinstance(cause, Unavailable):  # its message is ours, written for the client
        return APIError(503, str(cause), type="service_unavailable", code=cause.code,
                        retry_after_s=cause.retry_after_s)
    if isinstance(cause, DeadlineExceeded):
        return APIError(504, str(cause), type="timeout_error", code="deadline_exceeded")
    message = client_message(error)
    if message is not None:  # the engine's checks: the prompt is what it refused
        return bad_request(message, param, code="invalid_prompt")
    return server_error(error)


def client_message(error: BaseException) -> str | None:
    """The message of a ValueError our own checks raised (the engine's prompt checks arrive
    wrapped in Ray's RayTaskError), or None for anything else. A message of several lines or
    with control characters is not one of ours: it is treated as the server's failure."""
    cause = root_cause(error)
    if not isinstance(cause, ValueError) or isinstance(cause, ray.exceptions.RayError):
        return None
    message = str(cause).strip()
    if not message or any(ord(c) < 32 for c in message):
        return None
    return message


def server_error(error: BaseException) -> APIError:
    reference = uuid.uuid4().hex[:12]
    log.error("request failed (error reference %s)", reference, exc_info=error)
    cause = root_cause(error)
    if isinstance(cause, RequestFailed):  # the engine wrote its message for the client
        return APIError(500, f"{cause} (error reference {reference})", type="server_error",
                        code="request_failed")
    # an ActorDiedError's cause is what killed the actor: the error itself says what it is
    if any(isinstance(e, ReplicaFailure | ray.exceptions.RayActorError) for e in (error, cause)):
        return APIError(503, "The engine replica running this request failed and is being "
                        f"restarted: retry the request (error reference {reference}).",
                        type="service_unavailable", code="replica_failed",
                        retry_after_s=LOST_REPLICA_RETRY_AFTER_S)
    return APIError(500, f"The server failed while running this request (error reference "
                    f"{reference}); its log has the details.", type="server_error",
                    code="internal_error")


def not_ready(error: BaseException) -> APIError:
    """/health's 503 when the cluster's state could not be read: the reason goes to the log,
    not into the body."""
    reference = uuid.uuid4().hex[:12]
    log.warning("health check failed (error reference %s): %s", reference, error)
    return APIError(503, f"The engine is not ready: a replica is down or restarting (error "
                    f"reference {reference}).", type="service_unavailable", code="not_ready",
                    retry_after_s=LOST_REPLICA_RETRY_AFTER_S)


def root_cause(error: BaseException) -> BaseException:
    """The exception raised where it began: Ray wraps an actor's error in a RayTaskError
    whose ``cause`` is the original."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException) and cause is not error:
        return root_cause(cause)
    return error
