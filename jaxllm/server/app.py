"""OpenAI-compatible HTTP server over a `GenerationExecutor` (FastAPI on uvicorn).

Routes: POST /v1/completions, POST /v1/chat/completions (both stream as server-sent
events, with `stream_options.include_usage`), GET /v1/models, /health, /version, /metrics
(Prometheus text, jaxllm.server.metrics) and /v1/iteration_stats (TensorRT-LLM's JSON stats).
Errors use OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: 400 for bad
input (naming the field), 401 for a wrong API key, 404 for an unknown model, 408 for a body
that arrives too slowly, 413 for an oversized body, 503 while shutting down; anything else
is a JSON 500. A client that disconnects has its request aborted, which frees its blocks.

Nothing slow runs on the event loop: parsing and validating a body, rendering the chat
template, tokenizing and submitting happen on a small thread pool, and token strings for
logprobs come from a table decoded once at start-up. Prompt text longer than
`max_seq_len` tokens could ever cover is refused before tokenizing.

Logprobs: /v1/completions returns OpenAI's legacy form, `top_logprobs` a dict keyed by token
text holding the `logprobs` most likely tokens plus the chosen one; tokens that decode to the
same text share one key (the more likely one's value is kept). /v1/chat/completions returns
exactly `top_logprobs` entries, best first, which include the chosen token when it is among
the most likely.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional, Union

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

import jaxllm
from jaxllm.executor.executor import GenerationExecutor
from jaxllm.executor.result import GenerationResult
from jaxllm.kv_cache.retention import KvCacheRetentionConfig
from jaxllm.lora.request import LoRARequest
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
    # Client-supplied Jinja templates can take unbounded time and memory to render (vLLM's flag).
    trust_request_chat_template: bool = False
    max_json_depth: int = 32  # deeper request bodies are refused (the API needs about 5 levels)
    body_timeout: float = 30.0  # seconds a request body may take to arrive (408 after)
    send_timeout: float = 30.0  # seconds a client may leave one response chunk unread (then dropped)
    shutdown_timeout: float = 30.0  # on SIGTERM, seconds streams may still run before they are aborted
    num_api_threads: int = 4  # threads that parse, render templates and tokenize off the event loop
    # LoRA adapters clients select by model name (`NAME` or `served_model_name:NAME`; --lora-modules).
    lora_modules: dict[str, LoRARequest] = field(default_factory=dict)


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


_BODY_LEFT_UNREAD = (408, 413)


def error_response(err: APIError) -> JSONResponse:
    """The error in OpenAI's shape. After a 408 or 413 the rest of the body may still be on the
    wire, so the connection is closed rather than reused for the client's next request."""
    headers = {"connection": "close"} if err.status in _BODY_LEFT_UNREAD else None
    return JSONResponse(error_body(err.status, err.message, err.param, err.err_type), status_code=err.status,
                        headers=headers)


class _BodyTooLarge(Exception):
    pass


class _SlowClient(OSError):
    """The client did not take a response chunk within `send_timeout` (treated as gone)."""


def _param_from_path(path: str) -> Optional[str]:
    head = path.split(".", 1)[0]
    return head or None


def parse_json_body(body: bytes, max_depth: int) -> dict:
    """Parse a request body, refusing (400) what is not a JSON object, nests deeper than
    `max_depth`, or holds strings that are not valid Unicode (lone surrogates such as
    "\\ud800", which JSON escapes can spell but no tokenizer can encode)."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise APIError(400, f"request body nests deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as exc:
                    bad = value[exc.start]
                    raise APIError(400, f"{path or 'body'}: contains a lone surrogate (U+{ord(bad):04X}), "
                                        "which is not valid Unicode", _param_from_path(path)) from None
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > max_depth:
            raise APIError(400, f"{path}: request body nests deeper than {max_depth} levels",
                           _param_from_path(path))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            child = f"{path}.{key}" if path else str(key)
            if isinstance(key, str):
                stack.append((key, depth, child))
            if isinstance(item, (str, dict, list)):
                stack.append((item, depth + 1, child))
    return data


def _param_of(message: str, candidates) -> Optional[str]:
    """The request field a ValueError message is about (messages start with the field name)."""
    head = message.split(":", 1)[0].split(" ", 1)[0].strip("'\"`")
    return head if head in candidates else None


class _DisconnectAwareStreamingResponse(StreamingResponse):
    """Streams while listening for the client going away, whatever the ASGI spec version;
    on a disconnect the body generator is cancelled, and its cleanup aborts the request.
    `on_close` runs in every case, even when the body never started (the client left at once)."""

    def __init__(self, content, *, on_close: Callable[[], None], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client is gone, or too slow (_SlowClient)
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            try:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                self._on_close()


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
        self.draining = False  # set on SIGTERM: new requests get 503
        self._live: set[GenerationResult] = set()  # results some response is still waiting on
        self._shutdown_aborted: set[GenerationResult] = set()
        self._abort_sent: "weakref.WeakSet[GenerationResult]" = weakref.WeakSet()
        from jaxllm.server.metrics import ServerMetrics

        self.metrics = ServerMetrics(executor, config.served_model_name)
        self._threads = ThreadPoolExecutor(max_workers=config.num_api_threads, thread_name_prefix="jaxllm-api")
        self._token_text = self._token_table()
        # A prompt of more characters than max_seq_len tokens can cover is refused before tokenizing.
        vocab = self._vocab_strings()
        longest = max((len(t) for t in vocab), default=0) or 64
        self.max_prompt_chars = 4 * longest * executor.max_seq_len

    # ------------------------------------------------------------------ start-up tables
    def _vocab_strings(self) -> list[str]:
        try:
            return list(self.tokenizer.get_vocab())
        except Exception:
            return []

    def _token_table(self) -> list[str]:
        """Every token's text, decoded once, so that logprobs never decode on the event loop."""
        engine = self.executor.engine
        size = len(self.tokenizer)
        model_config = getattr(engine, "model_config", None)
        if model_config is not None:
            size = max(size, int(model_config.vocab_size))
        with self.executor._encode_lock:
            return [self.tokenizer.decode([i]) for i in range(size)]

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ helpers
    async def off_loop(self, fn: Callable, *args) -> Any:
        """Run slow work (parsing, templates, tokenization) on the API thread pool."""
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    def check_admission(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", None, "service_unavailable")
        if not self.executor.is_healthy:
            raise APIError(503, "the engine is not healthy", None, "service_unavailable")

    def check_model(self, model: str) -> Optional[LoRARequest]:
        """The LoRA adapter `model` names (None: the base model); 404 for an unknown name."""
        base = self.config.served_model_name
        if model == base:
            return None
        adapters = self.config.lora_modules
        name = model[len(base) + 1:] if model.startswith(base + ":") else model
        if name in adapters:
            return adapters[name]
        served = ", ".join(f"`{m}`" for m in [base, *adapters])
        raise APIError(404, f"The model `{model}` does not exist; this server serves {served}.", "model",
                       "not_found_error")

    async def read_body(self, request: Request) -> bytes:
        try:
            body = await request.body()
        except _BodyTooLarge:
            raise APIError(413, f"request body exceeds {self.config.max_body_bytes} bytes", None) from None
        if len(body) > self.config.max_body_bytes:
            raise APIError(413, f"request body exceeds {self.config.max_body_bytes} bytes", None)
        return body

    def parse(self, model_cls, body: bytes):
        data = parse_json_body(body, self.config.max_json_depth)
        try:
            return model_cls.model_validate(data)
        except ValidationError as exc:
            raise _validation_error(exc) from None

    def encode(self, prompt: str, add_special_tokens: bool, field: str = "prompt") -> list[int]:
        if len(prompt) > self.max_prompt_chars:
            raise APIError(400, f"{field}: {len(prompt)} characters cannot fit in max_seq_len "
                                f"({self.executor.max_seq_len}) tokens", field)
        try:
            return self.executor.encode(prompt, add_special_tokens)
        except ValueError as exc:
            raise APIError(400, f"{field}: {exc}", field) from None

    def submit_all(self, prompts: list[Union[str, list[int]]], params_for, streaming: bool,
                   add_special_tokens: bool = True, texts: Optional[list[Optional[str]]] = None,
                   field: str = "prompt", lora_request: Optional[LoRARequest] = None,
                   kv_cache_retention_config: Optional[KvCacheRetentionConfig] = None) -> list[GenerationResult]:
        """Validate every prompt before queuing any (ValueError -> 400), then submit them all.
        Runs on the API thread pool: tokenizing may take a while. `field`: the request field
        the prompts come from, named in length errors."""
        executor = self.executor
        self.check_admission()
        requests = []
        try:
            for i, prompt in enumerate(prompts):
                ids = self.encode(prompt, add_special_tokens) if isinstance(prompt, str) else prompt
                if len(ids) >= executor.max_seq_len:  # before any per-token work on a huge prompt
                    raise APIError(400, f"{field}: {len(ids)} tokens leave no room to generate within "
                                        f"max_seq_len ({executor.max_seq_len})", field)
                request = executor.make_request(ids, params_for(len(ids)), streaming, lora_request=lora_request,
                                                kv_cache_retention_config=kv_cache_retention_config)
                text = prompt if isinstance(prompt, str) else (texts[i] if texts else None)
                if text is not None:
                    request.prompt = text
                executor.validate(request)
                requests.append(request)
        except ValueError as exc:
            raise APIError(400, str(exc), _param_of(str(exc), _PARAMS) or "prompt") from None
        self.check_admission()
        try:
            results = executor.submit_many(requests)
        except (ValueError, RuntimeError) as exc:
            status = 400 if isinstance(exc, ValueError) else 503
            raise APIError(status, str(exc), _param_of(str(exc), _PARAMS)) from None
        self._live.update(results)
        self.requests_total += len(results)
        return results

    def max_tokens_for(self, requested: Optional[int], prompt_len: int) -> int:
        if requested is not None:
            return requested
        return max(1, self.executor.max_seq_len - prompt_len)

    # ------------------------------------------------------------------ draining (SIGTERM)
    @property
    def num_live(self) -> int:
        return len(self._live)

    def start_draining(self) -> None:
        """Refuse new requests (503); the ones running go on. Thread-safe."""
        self.draining = True

    def abort_live(self) -> int:
        """Abort every request a response still waits on (its stream ends with an error event)."""
        live = list(self._live)
        for result in live:
            if not result.finished:
                self._shutdown_aborted.add(result)
                self._abort_sent.add(result)
                result.abort()
        return len(live)

    def _release(self, results: list[GenerationResult]) -> bool:
        """Forget finished responses; True if the shutdown aborted any of them."""
        aborted = False
        self.metrics.observe([r for r in results if r in self._live])
        for result in results:
            self._live.discard(result)
            if result in self._shutdown_aborted:
                self._shutdown_aborted.discard(result)
                aborted = True
        return aborted

    # ------------------------------------------------------------------ /v1/completions
    def _prepare_completion(self, raw: bytes) -> tuple[CompletionRequest, list[GenerationResult]]:
        body = self.parse(CompletionRequest, raw)
        lora_request = self.check_model(body.model)
        try:
            body.check_stream_options()
            prompts = body.prompts()
            if len(prompts) * body.n > self.config.max_prompts_per_request:
                raise ValueError(f"n: {len(prompts)} prompts x n={body.n} exceeds "
                                 f"{self.config.max_prompts_per_request} sequences per request")
            if body.stream and body.best_of is not None and body.best_of > body.n and not body.use_beam_search:
                raise ValueError("best_of: streaming is not supported when best_of > n")
            body.to_sampling_params(body.max_tokens or 1)  # field errors before tokenizing
            retention = body.retention_config()
        except ValueError as exc:
            raise APIError(400, str(exc), _param_of(str(exc), _PARAMS)) from None
        results = self.submit_all(prompts, lambda n: self._params(body, body.max_tokens, n), body.stream,
                                  body.add_special_tokens, lora_request=lora_request,
                                  kv_cache_retention_config=retention)
        return body, results

    async def completions(self, request: Request) -> Response:
        self.check_admission()
        body, results = await self.off_loop(self._prepare_completion, await self.read_body(request))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return _DisconnectAwareStreamingResponse(
                self._stream_completion(results, body, request_id), media_type="text/event-stream",
                headers=_SSE_HEADERS, on_close=lambda: self._close_stream(results))
        outputs = await self._gather(request, results)
        choices = []
        for p, out in enumerate(outputs):
            for c in out.outputs:
                choices.append({"index": p * body.n + c.index, "text": c.text,
                                "logprobs": self._completion_logprobs(c) if body.logprobs is not None else None,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                if body.prompt_logprobs is not None:
                    choices[-1]["prompt_logprobs"] = self._prompt_logprobs(c.prompt_logprobs)
        return JSONResponse({"id": request_id, "object": "text_completion", "created": int(time.time()),
                             "model": body.model, "choices": choices,
                             "usage": _usage(outputs)})

    def _params(self, body, requested: Optional[int], prompt_len: int):
        try:
            return body.to_sampling_params(self.max_tokens_for(requested, prompt_len))
        except ValueError as exc:
            raise APIError(400, str(exc), _param_of(str(exc), _PARAMS)) from None

    async def _stream_completion(self, results: list[GenerationResult], body: CompletionRequest,
                                 request_id: str) -> AsyncIterator[str]:
        created = int(time.time())
        model = body.model
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        finals: dict[int, RequestOutput] = {}
        ended: set[int] = set()
        failed = False
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
            if include_usage and not self._shutdown_aborted.intersection(results):
                yield _sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": _usage([finals[p] for p in sorted(finals)])})
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the request failed mid-stream: tell the client in-band
            logger.warning("stream %s failed: %r", request_id, exc)
            failed = True
            yield _sse(error_body(500, f"{type(exc).__name__}: {exc}", None, "server_error"))
        finally:
            self._abort_unfinished(results)
        if self._release(results) and not failed:
            yield _sse(error_body(503, "the server is shutting down: the request was aborted", None,
                                  "service_unavailable"))
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ /v1/chat/completions
    def _prepare_chat(self, raw: bytes) -> tuple[ChatCompletionRequest, list[GenerationResult]]:
        body = self.parse(ChatCompletionRequest, raw)
        lora_request = self.check_model(body.model)
        try:
            body.check_stream_options()
            body.to_sampling_params(body.requested_max_tokens() or 1)
            retention = body.retention_config()
            template = body.requested_chat_template()
        except ValueError as exc:
            raise APIError(400, str(exc), _param_of(str(exc), _PARAMS) or "messages") from None
        if template is not None and not self.config.trust_request_chat_template:
            raise APIError(400, "chat_template: request-supplied chat templates are refused; start the "
                                "server with --trust-request-chat-template to allow them", "chat_template")
        try:
            prompt = self._apply_chat_template(body, template)
        except ValueError as exc:
            raise APIError(400, str(exc), _param_of(str(exc), _PARAMS) or "messages") from None
        ids = self.encode(prompt, add_special_tokens=False, field="messages") if prompt else []
        if not ids:
            raise APIError(400, "messages: the rendered conversation is empty", "messages")
        results = self.submit_all([ids], lambda n: self._params(body, body.requested_max_tokens(), n), body.stream,
                                  texts=[prompt], field="messages", lora_request=lora_request,
                                  kv_cache_retention_config=retention)
        return body, results

    async def chat_completions(self, request: Request) -> Response:
        self.check_admission()
        body, results = await self.off_loop(self._prepare_chat, await self.read_body(request))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return _DisconnectAwareStreamingResponse(
                self._stream_chat(results[0], body, request_id), media_type="text/event-stream",
                headers=_SSE_HEADERS, on_close=lambda: self._close_stream(results))
        out = (await self._gather(request, results))[0]
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._chat_logprobs(c) if body.logprobs else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs]
        return JSONResponse({"id": request_id, "object": "chat.completion", "created": int(time.time()),
                             "model": body.model, "choices": choices, "usage": _usage([out])})

    def _apply_chat_template(self, body: ChatCompletionRequest, template: Optional[str]) -> str:
        if template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: the model's tokenizer has no chat template; use /v1/completions")
        messages = [m.as_template_dict() for m in body.messages]
        try:
            rendered = self.tokenizer.apply_chat_template(
                messages, chat_template=template, tokenize=False,
                add_generation_prompt=body.add_generation_prompt, **body.template_variables())
        except Exception as exc:  # template errors are caused by the messages
            raise ValueError(f"messages: the chat template failed: {exc}") from None
        if not isinstance(rendered, str):
            raise ValueError("messages: the chat template did not render to text")
        try:
            rendered.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("messages: the chat template rendered invalid Unicode") from None
        return rendered

    async def _stream_chat(self, result: GenerationResult, body: ChatCompletionRequest,
                           request_id: str) -> AsyncIterator[str]:
        created = int(time.time())
        model = body.model
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(choices: list[dict]) -> str:
            return _sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                         "choices": choices})

        final = None
        ended: set[int] = set()
        failed = False
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
            if include_usage and final is not None and result not in self._shutdown_aborted:
                yield _sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [], "usage": _usage([final])})
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("stream %s failed: %r", request_id, exc)
            failed = True
            yield _sse(error_body(500, f"{type(exc).__name__}: {exc}", None, "server_error"))
        finally:
            self._abort_unfinished([result])
        if self._release([result]) and not failed:
            yield _sse(error_body(503, "the server is shutting down: the request was aborted", None,
                                  "service_unavailable"))
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
            aborted = self._release(results)
        try:
            outputs = work.result()
        except asyncio.CancelledError:
            raise APIError(499, "client disconnected") from None
        except Exception as exc:
            raise APIError(500, f"{type(exc).__name__}: {exc}", None, "server_error") from None
        if aborted:
            raise APIError(503, "the server is shutting down: the request was aborted", None, "service_unavailable")
        return outputs

    def _close_stream(self, results: list[GenerationResult]) -> None:
        """A streaming response ended, however it ended: nothing of it may keep running."""
        self._abort_unfinished(results)
        self._release(results)

    def _abort_unfinished(self, results: list[GenerationResult]) -> None:
        """Abort what is still running (once per result); counts one disconnect per response."""
        aborted = False
        for result in results:
            if not result.finished and result not in self._abort_sent:
                self._abort_sent.add(result)
                result.abort()
                aborted = True
        if aborted:
            self.disconnects += 1

    def _token_str(self, token_id: int) -> str:
        table = self._token_text
        return table[token_id] if 0 <= token_id < len(table) else ""

    def _completion_logprobs(self, c: CompletionOutput, diff: bool = False) -> Optional[dict]:
        ids = c.token_ids_diff if diff else c.token_ids
        lps = c.logprobs_diff if diff else c.logprobs
        if lps is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = 0
        for token, entry in zip(ids, lps):
            text = self._token_str(token)
            chosen = entry.get(token)
            tokens.append(text)
            token_lps.append(chosen.logprob if chosen is not None else None)
            top: dict[str, float] = {}
            for t, lp in _ranked(entry):  # most likely first: a merged key keeps the likelier value
                top.setdefault(self._token_str(t), lp.logprob)
            if chosen is not None:
                top.setdefault(text, chosen.logprob)
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _prompt_logprobs(self, entries: Optional[list]) -> Optional[list]:
        """vLLM's `prompt_logprobs` in a completion choice: None for the first prompt token,
        then {token id: {logprob, rank, decoded_token}} per prompt token."""
        if entries is None:
            return None
        return [None if entry is None else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self._token_str(t)}
            for t, lp in entry.items()} for entry in entries]

    def _chat_logprobs(self, c: CompletionOutput, diff: bool = False) -> Optional[dict]:
        ids = c.token_ids_diff if diff else c.token_ids
        lps = c.logprobs_diff if diff else c.logprobs
        if lps is None:
            return None
        content = []
        for token, entry in zip(ids, lps):
            chosen = entry.get(token)
            item = self._chat_token(token, chosen.logprob if chosen is not None else None)
            item["top_logprobs"] = [self._chat_token(t, lp.logprob) for t, lp in _ranked(entry)]
            content.append(item)
        return {"content": content}

    def _chat_token(self, token_id: int, logprob: Optional[float]) -> dict:
        text = self._token_str(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def models(self) -> dict:
        base = {"id": self.config.served_model_name, "object": "model", "created": self.created,
                "owned_by": "jaxllm", "root": self.config.served_model_name, "parent": None,
                "max_model_len": self.executor.max_seq_len}
        adapters = [{**base, "id": name, "root": lora.lora_path, "parent": self.config.served_model_name}
                    for name, lora in self.config.lora_modules.items()]
        return {"object": "list", "data": [base, *adapters]}


def _ranked(entry: dict) -> list:
    """The ranked (top-N) entries of one token's logprobs, most likely first."""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda x: x[1].rank)


_PARAMS = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "best_of", "temperature",
           "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed", "logprobs", "top_logprobs",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "stream_options",
           "include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "echo", "suffix", "logit_bias",
           "tools", "tool_choice", "response_format", "chat_template", "chat_template_kwargs", "stream",
           "add_special_tokens", "add_generation_prompt", "kv_cache_retention_config", "use_beam_search",
           "length_penalty", "early_stopping", "prompt_logprobs", "logits_processors", "logits_processor",
           "logits_post_processor_name"}


def _validation_error(exc: ValidationError) -> APIError:
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    field = loc[0] if loc else None
    path = ".".join(loc)
    message = err.get("msg", "invalid value")
    if err.get("type") == "extra_forbidden":
        message = "unknown or unsupported field"
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
    """Checks the API key on /v1/ routes and /kv_cache_events and refuses bodies over the limit: by Content-Length
    at once, else while they stream in. Bounds slow clients: a body must arrive within
    `body_timeout` (else 408) and each response message must be taken within `send_timeout`
    (else the connection is dropped, which aborts its request). Pure ASGI, so streaming
    responses pass untouched."""

    def __init__(self, app, max_bytes: int, api_key: Optional[str], body_timeout: float = 30.0,
                 send_timeout: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.api_key = api_key
        self.body_timeout = body_timeout
        self.send_timeout = send_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", ()))
        path = scope.get("path", "")
        if self.api_key and (path.startswith("/v1/") or path == "/kv_cache_events"):  # events carry prompt tokens
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
        body_done = False
        body_deadline = time.monotonic() + self.body_timeout

        async def limited_receive():
            nonlocal received, body_done
            if body_done:
                return await receive()
            try:
                with anyio.fail_after(max(0.0, body_deadline - time.monotonic())):
                    message = await receive()
            except TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.body_timeout:g}s", None,
                               "invalid_request_error") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge()
                body_done = not message.get("more_body", False)
            return message

        async def timed_send(message):
            try:
                with anyio.fail_after(self.send_timeout):
                    await send(message)
            except TimeoutError:
                raise _SlowClient(f"the client took no data for {self.send_timeout:g}s") from None

        try:
            return await self.app(scope, limited_receive, timed_send)
        except _SlowClient as exc:
            logger.warning("dropping a connection: %s", exc)


def build_app(executor: GenerationExecutor, config: ServerConfig, *, shutdown_executor: bool = False) -> FastAPI:
    """The ASGI app. With `shutdown_executor` the app's lifespan shuts the executor down on exit."""
    from contextlib import asynccontextmanager

    server = OpenAIServer(executor, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            server.close()
            if shutdown_executor:
                await asyncio.get_running_loop().run_in_executor(None, executor.shutdown)

    app = FastAPI(title="jaxllm", version=jaxllm.__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error", exc_info=exc)
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}", None, "server_error"))

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
        if server.draining:
            return error_response(APIError(503, "the server is shutting down", None, "service_unavailable"))
        if executor.is_healthy:
            return Response(status_code=200)
        return error_response(APIError(503, f"engine unhealthy: {executor.error!r}", None, "service_unavailable"))

    @app.get("/metrics")
    def metrics() -> Response:  # sync: runs on a worker thread, as it waits for the engine between steps
        """Prometheus text format (jaxllm.server.metrics)."""
        from jaxllm.server.metrics import PROMETHEUS_CONTENT_TYPE

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

    app.add_middleware(GuardMiddleware, max_bytes=config.max_body_bytes, api_key=config.api_key,
                       body_timeout=config.body_timeout, send_timeout=config.send_timeout)
    return app
