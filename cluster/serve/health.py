"""GET /health from the cluster's state: 200 while some replica serves, 503 when none does.

- ``ok`` (200): every replica's engine and shards answer the health monitor;
- ``degraded`` (200): some replica is down or rebuilding; the others serve every request
  (in-flight ones fail over to them). Which replica, and why, is in the monitor's log only;
- ``unavailable`` (503): no replica serves now;
- ``draining`` (503): the server is shutting down (SIGTERM) and takes no new requests.

A 503 carries OpenAI's error body and ``Retry-After``, as every 503 of this server does.
"""

from fastapi.responses import JSONResponse, Response

from cluster.serve.openai_errors import APIError
from router.replica_router import ClusterHealth

MESSAGES = {
    "unavailable": "No engine replica is serving now: they are down or restarting.",
    "draining": "The server is shutting down and takes no new requests.",
}


def health_response(health: ClusterHealth, retry_after_s: int) -> Response:
    status = health.status
    if status in MESSAGES:
        return APIError(503, MESSAGES[status], type="service_unavailable", code=status,
                        retry_after_s=retry_after_s).response()
    return JSONResponse({"status": status, "replicas": len(health.alive),
                         "replicas_up": sum(health.alive)})
