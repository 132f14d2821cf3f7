"""POST /v1/completions: one or more prompts, `n` choices each, as JSON or server-sent events.

Logprobs come in OpenAI's legacy form: `top_logprobs` a dict keyed by token text holding
the `logprobs` most likely tokens plus the chosen one; tokens that decode to the same text
share one key (the more likely one's value is kept). `prompt_logprobs` is vLLM's extension.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from jaxllm.executor.result import GenerationResult
from jaxllm.outputs import CompletionOutput, RequestOutput
from jaxllm.server.errors import bad_request, error_body
from jaxllm.server.protocol import CompletionRequest
from jaxllm.server.serving import OpenAIServer, ranked_logprobs
from jaxllm.server.streaming import (
    SSE_DONE,
    SSE_HEADERS,
    DisconnectAwareStreamingResponse,
    has_news,
    merge_streams,
    sse,
    usage,
)

logger = logging.getLogger(__name__)


class CompletionsRoute:
    """The /v1/completions handler over a server."""

    def __init__(self, server: OpenAIServer) -> None:
        self.server = server

    async def __call__(self, request: Request) -> Response:
        server = self.server
        server.check_admission()
        body, results = await server.off_loop(self._prepare, await server.read_body(request))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return DisconnectAwareStreamingResponse(
                self._stream(results, body, request_id),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
                on_close=lambda: server.close_stream(results),
            )
        outputs = await server.gather(request, results)
        disagg = body.disaggregated_params
        context_only = disagg is not None and disagg.request_type == "context_only"
        choices = []
        for p, out in enumerate(outputs):
            for c in out.outputs:
                choices.append(
                    {
                        "index": p * body.n + c.index,
                        "text": c.text,
                        "logprobs": self._logprobs(c) if body.logprobs is not None else None,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
                if body.prompt_logprobs is not None:
                    choices[-1]["prompt_logprobs"] = self._prompt_logprobs(c.prompt_logprobs)
                if context_only:  # the handle a generation worker claims the blocks with
                    choices[-1]["disaggregated_params"] = server.disagg.context_answer(results[p], c)
        return JSONResponse(
            {
                "id": request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": body.model,
                "choices": choices,
                "usage": usage(outputs),
            }
        )

    def _prepare(self, raw: bytes) -> tuple[CompletionRequest, list[GenerationResult]]:
        """Parse, tokenize and submit (on the API thread pool)."""
        server = self.server
        body = server.parse(CompletionRequest, raw)
        lora_request = server.check_model(body.model)
        try:
            body.check_stream_options()
            prompts = body.prompts()
            if len(prompts) * body.n > server.config.max_prompts_per_request:
                raise ValueError(
                    f"n: {len(prompts)} prompts x n={body.n} exceeds "
                    f"{server.config.max_prompts_per_request} sequences per request"
                )
            body.to_sampling_params(body.max_tokens or 1)  # field errors before tokenizing
            retention = body.retention_config()
        except ValueError as exc:
            raise bad_request(exc) from None
        server.check_guided_decoding(body)
        disagg = server.disagg.params_for(body)  # a generation-only request's blocks are pulled here
        max_tokens = 1 if disagg is not None and disagg.context_only else body.max_tokens
        results = server.submit_all(
            prompts,
            lambda n: server.sampling_params_for(body, max_tokens, n),
            body.stream,
            body.add_special_tokens,
            lora_request=lora_request,
            kv_cache_retention_config=retention,
            disaggregated_params=disagg,
        )
        return body, results

    async def _stream(
        self, results: list[GenerationResult], body: CompletionRequest, request_id: str
    ) -> AsyncIterator[str]:
        server = self.server
        created = int(time.time())
        model = body.model
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        finals: dict[int, RequestOutput] = {}
        ended: set[int] = set()
        failed = False
        try:
            async for p, out in merge_streams(results):
                choices = []
                for c in out.outputs:
                    index = p * body.n + c.index
                    if not has_news(c, index, ended, body.logprobs is not None):
                        continue
                    choices.append(
                        {
                            "index": index,
                            "text": c.text_diff,
                            "logprobs": (self._logprobs(c, diff=True) if body.logprobs is not None else None),
                            "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason,
                        }
                    )
                if out.finished:
                    finals[p] = out
                if choices:
                    yield sse(
                        {
                            "id": request_id,
                            "object": "text_completion",
                            "created": created,
                            "model": model,
                            "choices": choices,
                        }
                    )
            if include_usage and not server.aborted_by_shutdown(results):
                yield sse(
                    {
                        "id": request_id,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": usage([finals[p] for p in sorted(finals)]),
                    }
                )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the request failed mid-stream: tell the client in-band
            logger.warning("stream %s failed: %r", request_id, exc)
            failed = True
            yield sse(error_body(500, f"{type(exc).__name__}: {exc}", None, "server_error"))
        finally:
            server.abort_unfinished(results)
        if server.release(results) and not failed:
            yield sse(
                error_body(503, "the server is shutting down: the request was aborted", None, "service_unavailable")
            )
        yield SSE_DONE

    # ------------------------------------------------------------------ logprobs
    def _logprobs(self, c: CompletionOutput, diff: bool = False) -> dict | None:
        """OpenAI's legacy `logprobs` of a choice (of its new tokens with `diff`)."""
        token_text = self.server.token_text
        ids = c.token_ids_diff if diff else c.token_ids
        lps = c.logprobs_diff if diff else c.logprobs
        if lps is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = 0
        for token, entry in zip(ids, lps, strict=False):
            text = token_text(token)
            chosen = entry.get(token)
            tokens.append(text)
            token_lps.append(chosen.logprob if chosen is not None else None)
            top: dict[str, float] = {}
            for t, lp in ranked_logprobs(entry):  # most likely first: a merged key keeps the likelier value
                top.setdefault(token_text(t), lp.logprob)
            if chosen is not None:
                top.setdefault(text, chosen.logprob)
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _prompt_logprobs(self, entries: list | None) -> list | None:
        """vLLM's `prompt_logprobs` in a completion choice: None for the first prompt token,
        then {token id: {logprob, rank, decoded_token}} per prompt token."""
        if entries is None:
            return None
        token_text = self.server.token_text
        return [
            None
            if entry is None
            else {
                str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": token_text(t)}
                for t, lp in entry.items()
            }
            for entry in entries
        ]
