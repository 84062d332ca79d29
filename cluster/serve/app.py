"""The HTTP ingress: FastAPI apps in a Ray Serve deployment, in front of one ``TandemCluster``.

    serve run deploy/serve.yaml            # or: tandem serve --model smollm2-135m-instruct

Two deployments make an application::

    HTTP -> Serve proxy -> TandemServer (x ingress_replicas) -> router and engine replicas
                           EngineHost (one replica): starts those actors, owns them

``EngineHost`` (one replica) starts the cluster's actors and owns them for the app's life;
every ``TandemServer`` replica attaches to the same actors, so the ingress (HTTP parsing, SSE
encoding, one event loop per replica) scales without starting more engines.

``build_app`` makes the FastAPI app for one service (no Ray needed, no module state); the
``TandemServer`` deployment builds it when its replica starts (``serve.ingress()`` late-bound),
and ``app_builder`` is what a Serve config file's ``import_path`` names.
"""

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException

from cluster.engine.tokenizer import load_tokenizer
from cluster.serve.config import ServeConfig, load_config
from cluster.serve.deadlines import HEADER as DEADLINE_HEADER
from cluster.serve.deadlines import deadline_of
from cluster.serve.failures import not_ready, server_error
from cluster.serve.health import health_response
from cluster.serve.http_guards import APIKeyGuard, BodyLimit
from cluster.serve.openai_errors import (
    APIError,
    from_http_error,
    from_validation_errors,
    invalid_utf8,
)
from cluster.serve.openai_service import OpenAIService
from cluster.serve.prometheus import make_registry, render
from cluster.serve.protocol import ChatCompletionRequest, CompletionRequest
from cluster.serve.request_streams import Cluster

if TYPE_CHECKING:
    from cluster.ray.tandem_cluster import ClusterHandles, TandemCluster


def build_app(service: OpenAIService, config: ServeConfig) -> FastAPI:
    app = FastAPI(title="tandem", description="OpenAI-compatible API of a tandem cluster")
    cluster = service.cluster

    def deadline(raw: Request) -> float | None:
        return deadline_of(raw.headers.get(DEADLINE_HEADER), config.request_timeout)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        return respond(await service.completions(request, deadline(raw)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
        return respond(await service.chat(request, deadline(raw)))

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(service.models().model_dump())

    @app.get("/v1/models/{model_id:path}")  # a served name may hold slashes (org/name)
    async def model(model_id: str) -> Response:
        return JSONResponse(service.model(model_id).model_dump())

    @app.get("/health")
    async def health() -> Response:
        try:
            state = await cluster.health()
        except Exception as error:  # the router is gone or restarting
            return not_ready(error).response()
        return health_response(state, config.retry_after)

    @app.get("/metrics")
    async def metrics() -> Response:
        snapshots, router = await cluster.metrics(), await cluster.router_stats()
        body = render(make_registry(service.model_name, lambda: snapshots, lambda: router))
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    add_error_handlers(app)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(APIKeyGuard, api_key=config.api_key)  # outermost: checked first
    return app


def respond(result: Any) -> Response:
    if hasattr(result, "__aiter__"):
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return JSONResponse(result.model_dump())


def add_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, error: Exception) -> Response:
        assert isinstance(error, APIError)
        return error.response()

    async def invalid(_: Request, error: Exception) -> Response:
        assert isinstance(error, RequestValidationError)
        return from_validation_errors(error.errors()).response()

    async def http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        # FastAPI's "error parsing the body" for bytes that are not UTF-8 (JSON's encoding)
        if error.status_code == 400 and isinstance(error.__cause__, UnicodeDecodeError):
            return invalid_utf8(error.__cause__).response()
        return from_http_error(error.status_code, str(error.detail), request.method,
                               request.url.path, dict(error.headers or {})).response()

    async def unexpected(_: Request, error: Exception) -> Response:
        return server_error(error).response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


def start_cluster(config: ServeConfig, app_name: str = "") -> "TandemCluster":
    """``app_name``: the Serve app's, which the router's name starts with (`tandem serve`
    finds it by that to drain it: cluster/cli/drain.py)."""
    from cluster.ray.tandem_cluster import TandemCluster

    return TandemCluster(config.engine_config(), num_replicas=config.initial_replicas,
                         routing=config.routing, autoscaling=config.autoscaling,
                         policy=config.serving_policy(), group=app_name)


APP_NAME = "tandem"  # the application `tandem serve` runs
ENGINES_DEPLOYMENT = "tandem-engines"


@serve.deployment(name=ENGINES_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0})
class EngineHost:
    """Starts the cluster (router and engine replica actors) and owns it while the app lives."""

    async def __init__(self, config: ServeConfig) -> None:
        app_name = serve.get_replica_context().app_name
        self.cluster = await asyncio.to_thread(start_cluster, config, app_name)

    def handles(self) -> "ClusterHandles":
        return self.cluster.handles()

    def __del__(self) -> None:
        self.cluster.shutdown()


@serve.deployment(name="tandem", ray_actor_options={"num_cpus": 0})
@serve.ingress()
class TandemServer:
    """One ingress replica: the HTTP API over the cluster that ``EngineHost`` owns."""

    async def __init__(self, config: ServeConfig, engines: DeploymentHandle) -> None:
        from cluster.ray.tandem_cluster import TandemCluster

        self.config = config
        self.cluster: Cluster = TandemCluster.attach(await engines.handles.remote())
        tokenizer = load_tokenizer(self.cluster.model_path)
        self.service = OpenAIService(self.cluster, tokenizer, config.model_name)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_app(self.service, self.config)


def server_app(config: ServeConfig, graceful_shutdown_s: float | None = None) -> Application:
    """``graceful_shutdown_s``: how long a stopping ingress replica waits for its open
    requests; by default ``drain_timeout`` (Serve's own drain, as under KubeRay); `tandem serve`
    drains the app itself first and passes a short one."""
    engines = EngineHost.bind(config)
    return TandemServer.options(
        num_replicas=config.num_ingress_replicas,
        max_ongoing_requests=config.max_ongoing_requests,
        graceful_shutdown_timeout_s=(config.drain_timeout if graceful_shutdown_s is None
                                     else graceful_shutdown_s),
    ).bind(config, engines)


def app_builder(args: dict[str, Any]) -> Application:
    """The Serve config file's entry point: ``import_path: cluster.serve.app:app_builder``."""
    return server_app(load_config(dict(args)))
