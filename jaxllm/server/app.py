"""OpenAI-compatible HTTP server over a `GenerationExecutor` (FastAPI on uvicorn).

Routes: POST /v1/completions (`completions`), POST /v1/chat/completions (`chat`) - both
stream as server-sent events, with `stream_options.include_usage` - GET /v1/models,
/health, /version, /metrics (Prometheus text, `metrics`), /v1/iteration_stats
(TensorRT-LLM's JSON stats) and POST /kv_cache_events. Errors use OpenAI's shape
(`errors`); the API key and body limits are checked before any route (`guard`). A client
that disconnects has its request aborted, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import jaxllm
from jaxllm.executor.executor import GenerationExecutor
from jaxllm.server.chat import ChatRoute
from jaxllm.server.completions import CompletionsRoute
from jaxllm.server.errors import APIError, error_response
from jaxllm.server.guard import BodyTooLarge, GuardMiddleware
from jaxllm.server.server_config import ServerConfig
from jaxllm.server.server_metrics import PROMETHEUS_CONTENT_TYPE
from jaxllm.server.serving import OpenAIServer

logger = logging.getLogger(__name__)

KV_EVENTS_PAGE = 1000  # events per /kv_cache_events response unless ?max_events= says otherwise
MAX_KV_EVENTS_PAGE = 10_000


def kv_events_page(value: Optional[str]) -> int:
    """The `max_events` query parameter of /kv_cache_events (APIError 400 naming it)."""
    if value is None:
        return KV_EVENTS_PAGE
    if not (value.isdecimal() and len(value) <= 6 and 1 <= int(value) <= MAX_KV_EVENTS_PAGE):
        shown = value[:40]
        raise APIError(400, f"max_events must be an integer in [1, {MAX_KV_EVENTS_PAGE}], got {shown!r}", "max_events")
    return int(value)


def json_list_bytes(items: list[Any]) -> bytes:
    """`items` as a JSON list, encoded as `JSONResponse` encodes it but one item at a time:
    the C encoder holds the GIL for a whole call, and the event loop must get it meanwhile."""
    encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode
    return b"[" + b",".join(encode(item).encode() for item in items) + b"]"


def build_app(executor: GenerationExecutor, config: ServerConfig, *, shutdown_executor: bool = False) -> FastAPI:
    """The ASGI app. With `shutdown_executor` the app's lifespan shuts the executor down on exit."""
    server = OpenAIServer(executor, config)
    completions_route = CompletionsRoute(server)
    chat_route = ChatRoute(server)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.disagg.start()  # the KV transfer server of a disaggregated worker (else nothing)
        try:
            yield
        finally:
            server.close()
            if shutdown_executor:
                await asyncio.get_running_loop().run_in_executor(None, executor.shutdown)

    app = FastAPI(
        title="jaxllm", version=jaxllm.__version__, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error", exc_info=exc)
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}", None, "server_error"))

    @app.exception_handler(BodyTooLarge)
    async def _too_large(_request: Request, _exc: BodyTooLarge) -> JSONResponse:
        return error_response(APIError(413, f"request body exceeds {config.max_body_bytes} bytes"))

    @app.exception_handler(404)
    async def _not_found(request: Request, _exc) -> JSONResponse:
        return error_response(APIError(404, f"no route {request.method} {request.url.path}", None, "not_found_error"))

    @app.exception_handler(405)
    async def _not_allowed(request: Request, _exc) -> JSONResponse:
        return error_response(
            APIError(
                405, f"method {request.method} is not allowed on {request.url.path}", None, "invalid_request_error"
            )
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await completions_route(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await chat_route(request)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(server.models())

    @app.get("/health")
    async def health() -> Response:
        if server.draining:
            return error_response(APIError(503, "the server is shutting down", None, "service_unavailable"))
        if executor.is_healthy:
            return Response(status_code=200)
        return error_response(APIError(503, f"engine unhealthy: {executor.error!r}", None, "service_unavailable"))

    @app.get("/metrics")
    def metrics() -> Response:  # sync: runs on a worker thread, as it waits for the engine between steps
        """Prometheus text format (jaxllm.server.server_metrics)."""
        return Response(server.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/v1/iteration_stats")
    async def iteration_stats() -> JSONResponse:
        """TensorRT-LLM's per-iteration stats (JSON list), the most recent window; reading keeps them."""
        return JSONResponse(server.metrics.iteration_stats.read())

    @app.post("/kv_cache_events")
    async def kv_cache_events(request: Request) -> Response:
        """KV cache events since the previous call (trtllm-serve's route; reading drains them),
        at most `?max_events=` (default and limit in `kv_events_page`) per response, the rest
        kept for the next call; [] unless the engine records them
        (kv_cache_config.event_buffer_max_size > 0). Built and encoded off the event loop:
        thousands of events are megabytes of JSON."""
        max_events = kv_events_page(request.query_params.get("max_events"))
        body = await server.off_loop(lambda: json_list_bytes(executor.get_kv_cache_events(0, max_events)))
        return Response(body, media_type="application/json")

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": jaxllm.__version__})

    app.add_middleware(
        GuardMiddleware,
        max_bytes=config.max_body_bytes,
        api_key=config.api_key,
        body_timeout=config.body_timeout,
        send_timeout=config.send_timeout,
    )
    return app
