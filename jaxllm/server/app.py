"""OpenAI-compatible HTTP server over a `GenerationExecutor` (FastAPI on uvicorn).

Routes: POST /v1/completions, POST /v1/chat/completions (both stream as server-sent
events, with `stream_options.include_usage`), GET /v1/models, /health, /metrics, /version.
Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 for bad
input (naming the field), 401 for a wrong API key, 404 for an unknown model, 413 for an
oversized body. A client that disconnects has its request aborted, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional, Union

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

import jaxllm
from jaxllm.executor.executor import GenerationExecutor
from jaxllm.executor.result import GenerationResult
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.server.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: Optional[str] = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_prompts_per_request: int = 256


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, err_type: Optional[str] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type or {400: "invalid_request_error", 401: "authentication_error",
                                     404: "not_found_error", 413: "invalid_request_error",
                                     503: "service_unavailable"}.get(status, "server_error")


def error_body(status: int, message: str, param: Optional[str] = None, err_type: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param, err.err_type), status_code=err.status)


class _BodyTooLarge(Exception):
    pass


def _param_of(message: str, candidates) -> Optional[str]:
    """The request field a ValueError message is about (messages start with the field name)."""
    head = message.split(":", 1)[0].split(" ", 1)[0].strip("'\"`")
    return head if head in candidates else None


class _DisconnectAwareStreamingResponse(StreamingResponse):
    """Streams while listening for the client going away, whatever the ASGI spec version;
    on a disconnect the body generator is cancelled, and its cleanup aborts the request."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class OpenAIServer:
    """Binds the routes to one executor."""

    def __init__(self, executor: GenerationExecutor, config: ServerConfig) -> None:
        self.executor = executor
        self.config = config
        self.tokenizer = executor.tokenizer
        self.created = int(time.time())
        self.requests_total = 0
        self.disconnects = 0  # responses whose client left before the end (their requests were aborted)

    # ------------------------------------------------------------------ helpers
    def check_model(self, model: str) -> None:
        if model != self.config.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.config.served_model_name}`.", "model", "not_found_error")

    async def read_json(self, request: Request) -> Any:
        try:
            body = await request.body()
        except _BodyTooLarge:
            raise APIError(413, f"request body exceeds {self.config.max_body_bytes} bytes", None) from None
        if len(body) > self.config.max_body_bytes:
            raise APIError(413, f"request body exceeds {self.config.max_body_bytes} bytes", None)
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object")
        return data

    @staticmethod
    def parse(model_cls, data: dict):
        try:
            return model_cls.model_validate(data)
        except ValidationError as exc:
            raise _validation_error(exc) from None

    def submit_all(self, prompts: list[Union[str, list[int]]], params_for, streaming: bool,
                   add_special_tokens: bool = True) -> list[GenerationResult]:
        """Validate every prompt before queuing any (ValueError -> 400), then submit them all."""
        executor = self.executor
        if not executor.is_healthy:
            raise APIError(503, "the engine is not healthy", None, "service_unavailable")
        requests = []
        try:
            for prompt in prompts:
                ids = executor.encode(prompt, add_special_tokens) if isinstance(prompt, str) else prompt
                request = executor.make_request(ids, params_for(len(ids)), streaming)
                if isinstance(prompt, str):
                    request.prompt = prompt
                executor.validate(request)
                requests.append(request)
        except ValueError as exc:
            raise APIError(400, str(exc), _param_of(str(exc), _PARAMS) or "prompt") from None
        try:
            results = executor.submit_many(requests)
        except (ValueError, RuntimeError) as exc:
            status = 400 if isinstance(exc, ValueError) else 503
            raise APIError(status, str(exc), _param_of(str(exc), _PARAMS)) from None
        self.requests_total += len(results)
        return results

    def max_tokens_for(self, requested: Optional[int], prompt_len: int) -> int:
        if requested is not None:
            return requested
        return max(1, self.executor.max_seq_len - prompt_len)

    # ------------------------------------------------------------------ /v1/completions
    async def completions(self, request: Request) -> Response:
        body = self.parse(CompletionRequest, await self.read_json(request))
        self.check_model(body.model)
        try:
            body.check_stream_options()
            prompts = body.prompts()
            if len(prompts) * body.n > self.config.max_prompts_per_request:
                raise ValueError(f"n: {len(prompts)} prompts x n={body.n} exceeds "
                                 f"{self.config.max_prompts_per_request} sequences per request")
            if body.stream and body.best_of is not None and body.best_of > body.n:
                raise ValueError("best_of: streaming is not supported when best_of > n")
            body.to_sampling_params(body.max_tokens or 1)  # field errors before tokenizing
        except ValueError as exc:
            raise APIError(400, str(exc), _param_of(str(exc), _PARAMS)) from None
        if isinstance(body.prompt, list) and prompts and isinstance(prompts[0], list):
            for ids in prompts:
                if not all(isinstance(t, int) for t in ids):
                    raise APIError(400, "prompt: token id lists must hold integers", "prompt")
        results = self.submit_all(prompts, lambda n: self._params(body, body.max_tokens, n), body.stream,
                                  body.add_special_tokens)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return _DisconnectAwareStreamingResponse(
                self._stream_completion(results, body, request_id), media_type="text/event-stream",
                headers=_SSE_HEADERS)
        outputs = await self._gather(request, results)
        choices = []
        for p, out in enumerate(outputs):
            for c in out.outputs:
                choices.append({"index": p * body.n + c.index, "text": c.text,
                                "logprobs": self._completion_logprobs(c) if body.logprobs is not None else None,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return JSONResponse({"id": request_id, "object": "text_completion", "created": int(time.time()),
                             "model": self.config.served_model_name, "choices": choices,
                             "usage": _usage(outputs)})

    def _params(self, body, requested: Optional[int], prompt_len: int):
        try:
            return body.to_sampling_params(self.max_tokens_for(requested, prompt_len))
        except ValueError as exc:
            raise APIError(400, str(exc), _param_of(str(exc), _PARAMS)) from None

    async def _stream_completion(self, results: list[GenerationResult], body: CompletionRequest,
                                 request_id: str) -> AsyncIterator[str]:
        created = int(time.time())
        model = self.config.served_model_name
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        finals: dict[int, RequestOutput] = {}
        ended: set[int] = set()
        try:
            async for p, out in _merge(results):
                choices = []
                for c in out.outputs:
                    index = p * body.n + c.index
                    if not _has_news(c, index, ended, body.logprobs is not None):
                        continue
                    choices.append({"index": index, "text": c.text_diff,
                                    "logprobs": (self._completion_logprobs(c, diff=True)
                                                 if body.logprobs is not None else None),
                                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                if out.finished:
                    finals[p] = out
                if choices:
                    yield _sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                                "choices": choices})
            if include_usage:
                yield _sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": _usage([finals[p] for p in sorted(finals)])})
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the request failed mid-stream: tell the client in-band
            logger.warning("stream %s failed: %r", request_id, exc)
            yield _sse(error_body(500, f"{type(exc).__name__}: {exc}", None, "server_error"))
        finally:
            self._abort_unfinished(results)
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ /v1/chat/completions
    async def chat_completions(self, request: Request) -> Response:
        body = self.parse(ChatCompletionRequest, await self.read_json(request))
        self.check_model(body.model)
        try:
            body.check_stream_options()
            body.to_sampling_params(body.requested_max_tokens() or 1)
            prompt = self._apply_chat_template(body)
        except ValueError as exc:
            raise APIError(400, str(exc), _param_of(str(exc), _PARAMS) or "messages") from None
        ids = self.executor.encode(prompt, add_special_tokens=False) if prompt else []
        if not ids:
            raise APIError(400, "messages: the rendered conversation is empty", "messages")
        results = self.submit_all([ids], lambda n: self._params(body, body.requested_max_tokens(), n), body.stream)
        results[0].request.prompt = prompt
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return _DisconnectAwareStreamingResponse(
                self._stream_chat(results[0], body, request_id), media_type="text/event-stream",
                headers=_SSE_HEADERS)
        out = (await self._gather(request, results))[0]
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._chat_logprobs(c) if body.logprobs else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs]
        return JSONResponse({"id": request_id, "object": "chat.completion", "created": int(time.time()),
                             "model": self.config.served_model_name, "choices": choices, "usage": _usage([out])})

    def _apply_chat_template(self, body: ChatCompletionRequest) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: the model's tokenizer has no chat template; use /v1/completions")
        messages = [m.as_template_dict() for m in body.messages]
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=body.add_generation_prompt,
                **(body.chat_template_kwargs or {}))
        except Exception as exc:  # template errors are caused by the messages
            raise ValueError(f"messages: the chat template failed: {exc}") from None
        if not isinstance(rendered, str):
            raise ValueError("messages: the chat template did not render to text")
        return rendered

    async def _stream_chat(self, result: GenerationResult, body: ChatCompletionRequest,
                           request_id: str) -> AsyncIterator[str]:
        created = int(time.time())
        model = self.config.served_model_name
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(choices: list[dict]) -> str:
            return _sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                         "choices": choices})

        final = None
        ended: set[int] = set()
        try:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(body.n)])
            async for out in result:
                choices = []
                for c in out.outputs:
                    if not _has_news(c, c.index, ended, body.logprobs):
                        continue
                    choices.append({"index": c.index, "delta": {"content": c.text_diff} if c.text_diff else {},
                                    "logprobs": self._chat_logprobs(c, diff=True) if body.logprobs else None,
                                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                if out.finished:
                    final = out
                if choices:
                    yield chunk(choices)
            if include_usage and final is not None:
                yield _sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [], "usage": _usage([final])})
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("stream %s failed: %r", request_id, exc)
            yield _sse(error_body(500, f"{type(exc).__name__}: {exc}", None, "server_error"))
        finally:
            self._abort_unfinished([result])
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ shared
    async def _gather(self, request: Request, results: list[GenerationResult]) -> list[RequestOutput]:
        """Wait for every result, aborting them all if the client disconnects first."""
        work = asyncio.ensure_future(asyncio.gather(*(r.aresult() for r in results)))
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
                self._abort_unfinished(results)
        try:
            return work.result()
        except asyncio.CancelledError:
            raise APIError(499, "client disconnected") from None
        except Exception as exc:
            raise APIError(500, f"{type(exc).__name__}: {exc}", None, "server_error") from None

    def _abort_unfinished(self, results: list[GenerationResult]) -> None:
        aborted = False
        for result in results:
            if not result.finished:
                result.abort()
                aborted = True
        if aborted:
            self.disconnects += 1

    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _completion_logprobs(self, c: CompletionOutput, diff: bool = False) -> Optional[dict]:
        ids = c.token_ids_diff if diff else c.token_ids
        lps = c.logprobs_diff if diff else c.logprobs
        if lps is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = 0
        for token, entry in zip(ids, lps):
            text = self._token_str(token)
            tokens.append(text)
            token_lps.append(entry[token].logprob if token in entry else None)
            tops.append({self._token_str(t): lp.logprob for t, lp in entry.items() if t != token or lp.rank})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, c: CompletionOutput, diff: bool = False) -> Optional[dict]:
        ids = c.token_ids_diff if diff else c.token_ids
        lps = c.logprobs_diff if diff else c.logprobs
        if lps is None:
            return None
        content = []
        for token, entry in zip(ids, lps):
            text = self._token_str(token)
            top = sorted(((t, lp) for t, lp in entry.items() if lp.rank), key=lambda x: x[1].rank)
            content.append({"token": text, "logprob": entry[token].logprob if token in entry else None,
                            "bytes": list(text.encode()),
                            "top_logprobs": [{"token": self._token_str(t), "logprob": lp.logprob,
                                              "bytes": list(self._token_str(t).encode())} for t, lp in top]})
        return {"content": content}

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.config.served_model_name, "object": "model",
                                            "created": self.created, "owned_by": "jaxllm",
                                            "max_model_len": self.executor.max_seq_len}]}


_PARAMS = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "best_of", "temperature",
           "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed", "logprobs", "top_logprobs",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "stream_options",
           "include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "echo", "suffix", "logit_bias",
           "tools", "tool_choice", "response_format"}


def _validation_error(exc: ValidationError) -> APIError:
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    field = loc[0] if loc else None
    path = ".".join(loc)
    message = err.get("msg", "invalid value")
    if err.get("type") == "extra_forbidden":
        message = "unknown field"
    elif err.get("type") == "missing":
        message = "field required"
    return APIError(400, f"{path}: {message}" if path else message, field)


def _has_news(c: CompletionOutput, index: int, ended: set[int], with_logprobs: bool) -> bool:
    """Whether a streamed choice has anything to send (its finish is sent exactly once)."""
    if c.finish_reason is not None:
        if index in ended:
            return False
        ended.add(index)
        return True
    return bool(c.text_diff) or (with_logprobs and bool(c.token_ids_diff))


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def _usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _merge(results: list[GenerationResult]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the streams of several results as their updates arrive."""
    if len(results) == 1:
        async for out in results[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, result: GenerationResult) -> None:
        try:
            async for out in result:
                queue.put_nowait((index, out, None))
        except Exception as exc:
            queue.put_nowait((index, None, exc))
        finally:
            queue.put_nowait((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(results)]
    try:
        remaining = len(tasks)
        while remaining:
            index, out, error = await queue.get()
            if error is not None:
                raise error
            if out is None:
                remaining -= 1
                continue
            yield index, out
    finally:
        for task in tasks:
            task.cancel()


class GuardMiddleware:
    """Checks the API key on /v1/ routes and refuses bodies over the limit: by Content-Length
    at once, else while they stream in. Pure ASGI, so streaming responses pass untouched."""

    def __init__(self, app, max_bytes: int, api_key: Optional[str]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.api_key = api_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", ()))
        if self.api_key and scope.get("path", "").startswith("/v1/"):
            if headers.get(b"authorization", b"").decode("latin-1") != f"Bearer {self.api_key}":
                response = error_response(APIError(401, "invalid or missing API key", None, "authentication_error"))
                return await response(scope, receive, send)
        try:
            too_large = int(headers.get(b"content-length", b"0")) > self.max_bytes
        except ValueError:
            too_large = False
        if too_large:
            return await error_response(APIError(413, f"request body exceeds {self.max_bytes} bytes"))(
                scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge()
            return message

        return await self.app(scope, limited_receive, send)


def build_app(executor: GenerationExecutor, config: ServerConfig, *, shutdown_executor: bool = False) -> FastAPI:
    """The ASGI app. With `shutdown_executor` the app's lifespan shuts the executor down on exit."""
    from contextlib import asynccontextmanager

    server = OpenAIServer(executor, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if shutdown_executor:
            await asyncio.get_running_loop().run_in_executor(None, executor.shutdown)

    app = FastAPI(title="jaxllm", version=jaxllm.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(_BodyTooLarge)
    async def _too_large(_request: Request, _exc: _BodyTooLarge) -> JSONResponse:
        return error_response(APIError(413, f"request body exceeds {config.max_body_bytes} bytes"))

    @app.exception_handler(404)
    async def _not_found(request: Request, _exc) -> JSONResponse:
        return error_response(APIError(404, f"no route {request.method} {request.url.path}", None, "not_found_error"))

    @app.exception_handler(405)
    async def _not_allowed(request: Request, _exc) -> JSONResponse:
        return error_response(APIError(405, f"method {request.method} is not allowed on {request.url.path}",
                                       None, "invalid_request_error"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.chat_completions(request)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(server.models())

    @app.get("/health")
    async def health() -> Response:
        if executor.is_healthy:
            return Response(status_code=200)
        return error_response(APIError(503, f"engine unhealthy: {executor.error!r}", None, "service_unavailable"))

    @app.get("/metrics")
    async def metrics() -> JSONResponse:
        return JSONResponse(executor.get_stats(0) if executor.is_healthy else [])

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": jaxllm.__version__})

    app.add_middleware(GuardMiddleware, max_bytes=config.max_body_bytes, api_key=config.api_key)
    return app
