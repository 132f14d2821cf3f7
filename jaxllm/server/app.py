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
import logging
from contextlib import asynccontextmanager

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


def build_app(executor: GenerationExecutor, config: ServerConfig, *, shutdown_executor: bool = False) -> FastAPI:
    """The ASGI app. With `shutdown_executor` the app's lifespan shuts the executor down on exit."""
    server = OpenAIServer(executor, config)
    completions_route = CompletionsRoute(server)
    chat_route = ChatRoute(server)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
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
    async def kv_cache_events() -> JSONResponse:
        """KV cache events since the previous call (trtllm-serve's route; reading drains them);
        [] unless the engine records them (kv_cache_config.event_buffer_max_size > 0)."""
        return JSONResponse(executor.get_kv_cache_events(timeout=0))

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
