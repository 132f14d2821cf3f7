"""`jaxllm disaggregated`: the OpenAI front end of disaggregated prefill and decode (the router
of TensorRT-LLM's `trtllm-serve disaggregated`).

Each /v1/completions or /v1/chat/completions request goes first to a context worker as a
`context_only` request (max_tokens=1, not streamed), whose answer carries the first token and
the handle of its held KV blocks; then, with that handle as `generation_only`
`disaggregated_params`, to a generation worker, whose answer - or stream - is the client's,
passed through as it comes. A request that ends with its first token (an end token, a stop
string, max_tokens=1) is answered from the context worker alone.

Routing: among the workers of a phase, the one with the fewest requests in flight that is not
marked down (ties in turn); for context workers, the one that was sent the longest prefix of the
prompt (`jaxllm.server.disagg_prefix`: chained hashes of its blocks) while it is not much busier
than the rest, as its prefix cache may hold those blocks. A worker that cannot be
reached is marked down until a health check (`/health`, every `health_check_interval_s`) finds it
up again. A context worker that
fails before its answer is retried on another; a generation worker that cannot be reached
is retried on another too (it never saw the handle); one that fails once it has the request
fails that request alone (a 502, or an error event in the stream). `/health` is 200 while a
worker of each phase is up; `/metrics` counts requests, retries and failures per worker.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

import jaxllm
from jaxllm.server import disagg_fanout as fanout
from jaxllm.server.disagg_config import DisaggConfig
from jaxllm.server.disagg_fanout import Answer
from jaxllm.server.disagg_prefix import PrefixIndex, block_hashes, prompt_text
from jaxllm.server.errors import APIError, error_body, error_response
from jaxllm.server.guard import GuardMiddleware, parse_json_body
from jaxllm.server.server_metrics import PROMETHEUS_CONTENT_TYPE
from jaxllm.server.streaming import SSE_DONE, SSE_HEADERS, sse

logger = logging.getLogger(__name__)

CONTEXT, GENERATION = "context", "generation"
MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass
class Worker:
    url: str
    phase: str
    in_flight: int = 0
    up: bool = True


class WorkerPool:
    """The workers of one phase: least requests in flight first, unreachable ones left out."""

    # A prompt keeps to the worker holding its longest prefix while that worker has at most
    # this many requests in flight more than the least loaded one.
    PREFIX_SLACK = 2

    def __init__(self, phase: str, urls: list[str]) -> None:
        self.phase = phase
        self.workers = [Worker(url, phase) for url in urls]
        self._turn = itertools.count()
        self.prefixes = PrefixIndex()

    def candidates(self, exclude: set[str], hashes: Optional[list[bytes]] = None) -> list[Worker]:
        """Workers to try, best first: those up by load (ties in turn), then those marked down.
        With `hashes` (the prompt's block hashes), the worker that was sent the longest
        prefix of it comes first unless it is busier than the least loaded by more than
        `PREFIX_SLACK`."""
        turn = next(self._turn)
        n = len(self.workers)
        ordered = [self.workers[(turn + i) % n] for i in range(n)]
        ordered = sorted((w for w in ordered if w.url not in exclude), key=lambda w: (not w.up, w.in_flight))
        if hashes and ordered:
            least = ordered[0].in_flight
            fits = [w for w in ordered if w.up and w.in_flight <= least + self.PREFIX_SLACK]
            matches = [(self.prefixes.match(w.url, hashes), w) for w in fits]
            best, home = max(matches, key=lambda m: m[0], default=(0, None))  # max keeps the first of equals
            if best > 0 and home is not None:
                ordered.remove(home)
                ordered.insert(0, home)
        return ordered

    @property
    def any_up(self) -> bool:
        return any(w.up for w in self.workers)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "jaxllm:disagg_requests", "Requests answered by the router, by outcome.", ["outcome"], registry=r
        )
        self.worker_requests = Counter(
            "jaxllm:disagg_worker_requests",
            "Requests sent to each worker, by outcome.",
            ["phase", "worker", "outcome"],
            registry=r,
        )
        self.retries = Counter("jaxllm:disagg_retries", "Requests sent again to another worker.", ["phase"], registry=r)
        self.in_flight = Gauge(
            "jaxllm:disagg_worker_in_flight", "Requests in flight per worker.", ["phase", "worker"], registry=r
        )
        self.up = Gauge("jaxllm:disagg_worker_up", "1 while the worker is reachable.", ["phase", "worker"], registry=r)
        self.context_seconds = Histogram(
            "jaxllm:disagg_context_seconds", "Context phase of a request (prefill and hand-over).", registry=r
        )


class WorkerFailed(Exception):
    """A worker could not be reached, or failed before answering."""


class DisaggRouter:
    """Sends each request through a context worker, then a generation worker."""

    def __init__(self, config: DisaggConfig, client: Optional[httpx.AsyncClient] = None) -> None:
        self.config = config
        self.pools = {
            CONTEXT: WorkerPool(CONTEXT, config.context_servers.urls),
            GENERATION: WorkerPool(GENERATION, config.generation_servers.urls),
        }
        headers = {"Authorization": f"Bearer {config.worker_api_key}"} if config.worker_api_key else {}
        self.client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(config.request_timeout_s, connect=5.0),
            headers=headers,
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64),
        )
        self.metrics = RouterMetrics()
        self._health_task: Optional[asyncio.Task] = None

    # ------------------------------------------------------------------ health
    async def start(self) -> None:
        await self.check_health()
        self._health_task = asyncio.ensure_future(self._health_loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        await self.client.aclose()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            try:
                await self.check_health()
            except Exception:  # a health check must never end the loop
                logger.warning("worker health check failed", exc_info=True)

    async def check_health(self) -> None:
        workers = [w for pool in self.pools.values() for w in pool.workers]
        results = await asyncio.gather(*(self._probe(w) for w in workers))
        for worker, up in zip(workers, results):
            if up != worker.up:
                logger.warning("%s worker %s is %s", worker.phase, worker.url, "up" if up else "down")
            self._mark(worker, up)

    async def _probe(self, worker: Worker) -> bool:
        try:
            return (await self.client.get(f"{worker.url}/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            return False

    def _mark(self, worker: Worker, up: bool) -> None:
        if not up:
            self.pools[worker.phase].prefixes.forget(worker.url)
        worker.up = up
        self.metrics.up.labels(worker.phase, worker.url).set(1 if up else 0)

    @property
    def healthy(self) -> bool:
        return all(pool.any_up for pool in self.pools.values())

    # ------------------------------------------------------------------ one request
    async def route(self, path: str, body: dict) -> Response:
        """Answer one request through a context worker and then a generation worker (with
        n > 1: one such request per sequence, the answers merged)."""
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        if body.get("disaggregated_params") is not None:
            raise APIError(400, "disaggregated_params is set by the router, not by clients", "disaggregated_params")
        if fanout.num_sequences(body) > 1:
            return await fanout.route_sequences(self, path, body)
        return self.respond(await self.route_one(path, body))

    def respond(self, answer: Answer) -> Response:
        """The client's response for one request's answer."""
        if answer.upstream is not None:
            worker, upstream = answer.upstream
            return StreamingResponse(self.relay(worker, upstream), media_type="text/event-stream", headers=SSE_HEADERS)
        if answer.events is not None:
            return Response("".join(answer.events), media_type="text/event-stream", headers=SSE_HEADERS)
        return Response(answer.content, status_code=answer.status, media_type="application/json")

    async def route_one(self, path: str, body: dict) -> Answer:
        """One sequence through a context worker and then a generation worker: its answer,
        or (streaming) the generation worker's open event stream."""
        started = time.perf_counter()
        status, ctx = await self._context_phase(path, body)
        self.metrics.context_seconds.observe(time.perf_counter() - started)
        if status != 200:  # the worker refused the request (a 400 naming the field): the client's answer
            self.metrics.requests.labels("context_error").inc()
            return Answer(status, json.dumps(ctx).encode())
        choice = (ctx.get("choices") or [{}])[0]
        handle = choice.pop("disaggregated_params", None) or {}
        if choice.get("finish_reason") != "length" or _max_tokens(path, body) == 1 or not handle.get("opaque_state"):
            self.metrics.requests.labels("context_only").inc()  # it ended with its first token
            if body.get("stream"):
                return Answer(200, b"", events=self._events_from_context(path, body, ctx))
            return Answer(200, json.dumps(ctx).encode())
        gen_body = dict(body, disaggregated_params=dict(handle, request_type="generation_only"))
        if body.get("stream"):
            return await self._stream_generation(path, gen_body)
        return await self._generation(path, gen_body)

    async def _context_phase(self, path: str, body: dict) -> tuple[int, dict]:
        ctx_body = dict(body, stream=False, max_tokens=1, disaggregated_params={"request_type": "context_only"})
        ctx_body.pop("stream_options", None)
        ctx_body.pop("max_completion_tokens", None)
        tried: set[str] = set()
        pool = self.pools[CONTEXT]
        text = prompt_text(body)
        hashes = block_hashes(text) if text else []
        for attempt, worker in enumerate(pool.candidates(tried, hashes)):
            if attempt:
                self.metrics.retries.labels(CONTEXT).inc()
            tried.add(worker.url)
            pool.prefixes.insert(worker.url, hashes)  # its cache will hold them once it ran the prompt
            try:
                response = await self._post(worker, path, ctx_body)
                return response.status_code, response.json()
            except (httpx.HTTPError, ValueError) as exc:  # unreachable, died, or not JSON: try another
                logger.warning("context worker %s failed: %r", worker.url, exc)
                self._mark(worker, False)
                self.metrics.worker_requests.labels(CONTEXT, worker.url, "failed").inc()
        raise APIError(503, "no context worker could take the request", None, "service_unavailable")

    async def _post(self, worker: Worker, path: str, body: dict) -> httpx.Response:
        worker.in_flight += 1
        self.metrics.in_flight.labels(worker.phase, worker.url).set(worker.in_flight)
        try:
            response = await self.client.post(worker.url + path, json=body)
            self.metrics.worker_requests.labels(worker.phase, worker.url, str(response.status_code)).inc()
            return response
        finally:
            worker.in_flight -= 1
            self.metrics.in_flight.labels(worker.phase, worker.url).set(worker.in_flight)

    async def _generation(self, path: str, body: dict) -> Answer:
        tried: set[str] = set()
        for attempt, worker in enumerate(self.pools[GENERATION].candidates(tried)):
            if attempt:
                self.metrics.retries.labels(GENERATION).inc()
            tried.add(worker.url)
            try:
                response = await self._post(worker, path, body)
            except httpx.ConnectError as exc:  # it never saw the request: the handle is still good
                logger.warning("generation worker %s unreachable: %r", worker.url, exc)
                self._mark(worker, False)
                continue
            except httpx.HTTPError as exc:
                self._mark(worker, False)
                self.metrics.requests.labels("generation_failed").inc()
                message = f"the generation worker failed: {type(exc).__name__}: {exc}"
                raise APIError(502, message, None, "server_error") from None
            self.metrics.requests.labels("ok" if response.status_code == 200 else "generation_error").inc()
            return Answer(response.status_code, response.content)
        self.metrics.requests.labels("generation_failed").inc()
        raise APIError(503, "no generation worker could take the request", None, "service_unavailable")

    async def _stream_generation(self, path: str, body: dict) -> Answer:
        tried: set[str] = set()
        for attempt, worker in enumerate(self.pools[GENERATION].candidates(tried)):
            if attempt:
                self.metrics.retries.labels(GENERATION).inc()
            tried.add(worker.url)
            worker.in_flight += 1
            try:
                request = self.client.build_request("POST", worker.url + path, json=body)
                upstream = await self.client.send(request, stream=True)
            except httpx.ConnectError as exc:
                worker.in_flight -= 1
                logger.warning("generation worker %s unreachable: %r", worker.url, exc)
                self._mark(worker, False)
                continue
            except httpx.HTTPError as exc:
                worker.in_flight -= 1
                self._mark(worker, False)
                self.metrics.requests.labels("generation_failed").inc()
                message = f"the generation worker failed: {type(exc).__name__}: {exc}"
                raise APIError(502, message, None, "server_error") from None
            self.metrics.worker_requests.labels(GENERATION, worker.url, str(upstream.status_code)).inc()
            if upstream.status_code != 200:
                content = await upstream.aread()
                await upstream.aclose()
                worker.in_flight -= 1
                self.metrics.requests.labels("generation_error").inc()
                return Answer(upstream.status_code, content)
            return Answer(200, b"", upstream=(worker, upstream))
        self.metrics.requests.labels("generation_failed").inc()
        raise APIError(503, "no generation worker could take the request", None, "service_unavailable")

    async def relay(self, worker: Worker, upstream: httpx.Response) -> AsyncIterator[bytes]:
        """The generation worker's events as they come; if it dies mid-stream, an error event."""
        tail = b""
        try:
            async for chunk in upstream.aiter_raw():
                tail = (tail + chunk)[-32:]
                yield chunk
            if b"data: [DONE]" not in tail:
                raise httpx.RemoteProtocolError("the stream ended without [DONE]")
            self.metrics.requests.labels("ok").inc()
        except httpx.HTTPError as exc:
            logger.warning("generation worker %s failed mid-stream: %r", worker.url, exc)
            self._mark(worker, False)
            self.metrics.requests.labels("generation_failed").inc()
            message = f"the generation worker failed mid-stream: {type(exc).__name__}: {exc}"
            yield sse(error_body(502, message, None, "server_error")).encode()
            yield SSE_DONE.encode()
        finally:
            worker.in_flight -= 1
            await upstream.aclose()

    async def discard(self, answer: Answer) -> None:
        """Let go of an answer that will not be sent (its stream is closed)."""
        if answer.upstream is not None:
            worker, upstream = answer.upstream
            worker.in_flight -= 1
            await upstream.aclose()

    def _events_from_context(self, path: str, body: dict, ctx: dict) -> list[str]:
        """A streamed request that ended with its first token: the context worker's answer
        as one chunk (and the usage chunk when asked for)."""
        chat = path.endswith("/chat/completions")
        events = []
        for choice in ctx.get("choices", []):
            if chat:
                message = choice.get("message") or {}
                part = {"index": choice.get("index", 0), "delta": message, "logprobs": None}
            else:
                part = {"index": choice.get("index", 0), "text": choice.get("text", ""), "logprobs": None}
            part.update(finish_reason=choice.get("finish_reason"), stop_reason=choice.get("stop_reason"))
            obj = "chat.completion.chunk" if chat else "text_completion"
            events.append(
                sse(
                    {
                        "id": ctx.get("id"),
                        "object": obj,
                        "created": ctx.get("created"),
                        "model": ctx.get("model"),
                        "choices": [part],
                    }
                )
            )
        if (body.get("stream_options") or {}).get("include_usage"):
            obj = "chat.completion.chunk" if chat else "text_completion"
            events.append(
                sse(
                    {
                        "id": ctx.get("id"),
                        "object": obj,
                        "created": ctx.get("created"),
                        "model": ctx.get("model"),
                        "choices": [],
                        "usage": ctx.get("usage"),
                    }
                )
            )
        events.append(SSE_DONE)
        return events

    async def models(self) -> Response:
        for worker in self.pools[GENERATION].candidates(set()):
            try:
                response = await self.client.get(worker.url + "/v1/models", timeout=5.0)
                return Response(response.content, status_code=response.status_code, media_type="application/json")
            except httpx.HTTPError:
                continue
        raise APIError(503, "no generation worker is reachable", None, "service_unavailable")


def _max_tokens(path: str, body: dict) -> Any:
    if path.endswith("/chat/completions") and body.get("max_completion_tokens") is not None:
        return body["max_completion_tokens"]
    return body.get("max_tokens", 16 if path.endswith("/v1/completions") else None)


def build_router_app(config: DisaggConfig) -> FastAPI:
    """The router's ASGI app (its lifespan starts the health checks and closes the client)."""
    router = DisaggRouter(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(
        title="jaxllm disaggregated",
        version=jaxllm.__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.router = router

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    async def read_json(request: Request) -> Any:
        return parse_json_body(await request.body(), 32)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.route("/v1/completions", await read_json(request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.route("/v1/chat/completions", await read_json(request))

    @app.get("/v1/models")
    async def models() -> Response:
        return await router.models()

    @app.get("/health")
    async def health() -> Response:
        if router.healthy:
            return Response(status_code=200)
        return error_response(APIError(503, "no context or no generation worker is up", None, "service_unavailable"))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=PROMETHEUS_CONTENT_TYPE)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": jaxllm.__version__})

    app.add_middleware(GuardMiddleware, max_bytes=MAX_BODY_BYTES, api_key=config.api_key)
    return app


def describe(config: DisaggConfig) -> str:
    """One line per phase, for the start-up banner."""
    return json.dumps(
        {"context_servers": config.context_servers.urls, "generation_servers": config.generation_servers.urls}
    )
