"""POST /v1/chat/completions: a conversation rendered with the chat template, `n` choices,
as JSON or server-sent events.

Logprobs come in the chat form: exactly `top_logprobs` entries per token, best first, which
include the chosen token when it is among the most likely. Client-supplied chat templates
are refused unless the server trusts them (`ServerConfig.trust_request_chat_template`).
Tools go to the chat template; the generated text is split into reasoning, content and tool
calls by `chat_output.ChatOutput` (parsers chosen by the server's flags and the request's
`tool_choice`, checked in `tool_request`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from jaxllm.executor.result import GenerationResult
from jaxllm.outputs import CompletionOutput
from jaxllm.sampling.guided import GuidedDecodingParams
from jaxllm.server.chat_output import ChatOutput, ChoiceStream, tool_finish_reason
from jaxllm.server.errors import APIError, bad_request, error_body
from jaxllm.server.protocol import ChatCompletionRequest
from jaxllm.server.reasoning import get_reasoning_parser
from jaxllm.server.serving import OpenAIServer, ranked_logprobs
from jaxllm.server.streaming import SSE_DONE, SSE_HEADERS, DisconnectAwareStreamingResponse, has_news, sse, usage
from jaxllm.server.tool_request import ToolPlan, guided_decoding_for_tool_choice, plan_tools, template_messages

logger = logging.getLogger(__name__)


class ChatRoute:
    """The /v1/chat/completions handler over a server."""

    def __init__(self, server: OpenAIServer) -> None:
        self.server = server
        name = server.config.reasoning_parser
        self.reasoning = get_reasoning_parser(name) if name else None

    async def __call__(self, request: Request) -> Response:
        server = self.server
        server.check_admission()
        body, plan, results = await server.off_loop(self._prepare, await server.read_body(request))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        output = ChatOutput(self.reasoning, plan.parser, plan.parallel_tool_calls)
        if body.stream:
            return DisconnectAwareStreamingResponse(
                self._stream(results[0], body, request_id, output),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
                on_close=lambda: server.close_stream(results),
            )
        out = (await server.gather(request, results))[0]
        choices = []
        for c in out.outputs:
            message, finish_reason = output.message(c.text, c.finish_reason)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(c) if body.logprobs else None,
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
            disagg = body.disaggregated_params
            if disagg is not None and disagg.request_type == "context_only":
                choices[-1]["disaggregated_params"] = server.disagg.context_answer(results[0], c)
        return JSONResponse(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.model,
                "choices": choices,
                "usage": usage([out]),
            }
        )

    def _prepare(self, raw: bytes) -> tuple[ChatCompletionRequest, ToolPlan, list[GenerationResult]]:
        """Parse, render the template, tokenize and submit (on the API thread pool)."""
        server = self.server
        body = server.parse(ChatCompletionRequest, raw)
        lora_request = server.check_model(body.model)
        try:
            body.check_stream_options()
            body.to_sampling_params(body.requested_max_tokens() or 1)
            retention = body.retention_config()
            template = body.requested_chat_template()
        except ValueError as exc:
            raise bad_request(exc, "messages") from None
        server.check_guided_decoding(body)
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, server.config)
        guided = None
        if plan.schema is not None:
            if body.guided_decoding()[0] is not None:
                raise APIError(
                    400,
                    "tool_choice: 'required' or a named function already constrains the output; "
                    "it cannot be combined with response_format or guided_* fields",
                    "tool_choice",
                )
            guided = guided_decoding_for_tool_choice(plan.schema)
        if template is not None and not server.config.trust_request_chat_template:
            raise APIError(
                400,
                "chat_template: request-supplied chat templates are refused; start the "
                "server with --trust-request-chat-template to allow them",
                "chat_template",
            )
        try:
            prompt = self._apply_chat_template(body, template, plan.tools)
        except ValueError as exc:
            raise bad_request(exc, "messages") from None
        ids = server.encode(prompt, add_special_tokens=False, field="messages") if prompt else []
        if not ids:
            raise APIError(400, "messages: the rendered conversation is empty", "messages")
        disagg = server.disagg.params_for(body)  # a generation-only request's blocks are pulled here
        context_only = disagg is not None and disagg.context_only
        results = server.submit_all(
            [ids],
            lambda n: self._sampling_params(body, n, guided, 1 if context_only else body.requested_max_tokens()),
            body.stream,
            texts=[prompt],
            field="messages",
            lora_request=lora_request,
            kv_cache_retention_config=retention,
            disaggregated_params=disagg,
        )
        return body, plan, results

    def _sampling_params(
        self, body: ChatCompletionRequest, prompt_len: int, guided: GuidedDecodingParams | None, max_tokens: int | None
    ):
        params = self.server.sampling_params_for(body, max_tokens, prompt_len)
        if guided is not None:
            params.guided_decoding = guided
        if params.guided_decoding is not None and self.reasoning is not None:
            # The thinking stays free; the constraint holds the answer after it.
            params.guided_decoding = dataclasses.replace(params.guided_decoding, reasoning=self.reasoning.span)
        return params

    def _apply_chat_template(self, body: ChatCompletionRequest, template: str | None, tools: list | None) -> str:
        tokenizer = self.server.tokenizer
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("messages: the model's tokenizer has no chat template; use /v1/completions")
        messages = template_messages([m.as_template_dict() for m in body.messages])
        try:
            rendered = tokenizer.apply_chat_template(
                messages,
                chat_template=template,
                tools=tools,
                tokenize=False,
                add_generation_prompt=body.add_generation_prompt,
                **body.template_variables(),
            )
        except Exception as exc:  # template errors are caused by the messages
            raise ValueError(f"messages: the chat template failed: {exc}") from None
        if not isinstance(rendered, str):
            raise ValueError("messages: the chat template did not render to text")
        try:
            rendered.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("messages: the chat template rendered invalid Unicode") from None
        return rendered

    async def _stream(
        self, result: GenerationResult, body: ChatCompletionRequest, request_id: str, output: ChatOutput
    ) -> AsyncIterator[str]:
        server = self.server
        created = int(time.time())
        model = body.model
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(choices: list[dict]) -> str:
            return sse(
                {
                    "id": request_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": choices,
                }
            )

        final = None
        ended: set[int] = set()
        streams: dict[int, ChoiceStream] = {}
        failed = False
        try:
            yield chunk(
                [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                    for i in range(body.n)
                ]
            )
            async for out in result:
                choices = []
                for c in out.outputs:
                    if not has_news(c, c.index, ended, body.logprobs):
                        continue
                    stream = streams.setdefault(c.index, output.stream())
                    delta = stream.step(c.text_diff, c.finish_reason is not None)
                    if not delta and c.finish_reason is None and not (body.logprobs and c.token_ids_diff):
                        continue  # held back: may begin a tag
                    choices.append(
                        {
                            "index": c.index,
                            "delta": delta,
                            "logprobs": self._logprobs(c, diff=True) if body.logprobs else None,
                            "finish_reason": tool_finish_reason(c.finish_reason, stream.called),
                            "stop_reason": c.stop_reason,
                        }
                    )
                if out.finished:
                    final = out
                if choices:
                    yield chunk(choices)
            if include_usage and final is not None and not server.aborted_by_shutdown([result]):
                yield sse(
                    {
                        "id": request_id,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": usage([final]),
                    }
                )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("stream %s failed: %r", request_id, exc)
            failed = True
            yield sse(error_body(500, f"{type(exc).__name__}: {exc}", None, "server_error"))
        finally:
            server.abort_unfinished([result])
        if server.release([result]) and not failed:
            yield sse(
                error_body(503, "the server is shutting down: the request was aborted", None, "service_unavailable")
            )
        yield SSE_DONE

    # ------------------------------------------------------------------ logprobs
    def _logprobs(self, c: CompletionOutput, diff: bool = False) -> dict | None:
        """The chat form of a choice's logprobs (of its new tokens with `diff`)."""
        ids = c.token_ids_diff if diff else c.token_ids
        lps = c.logprobs_diff if diff else c.logprobs
        if lps is None:
            return None
        content = []
        for token, entry in zip(ids, lps, strict=False):
            chosen = entry.get(token)
            item = self._token(token, chosen.logprob if chosen is not None else None)
            item["top_logprobs"] = [self._token(t, lp.logprob) for t, lp in ranked_logprobs(entry)]
            content.append(item)
        return {"content": content}

    def _token(self, token_id: int, logprob: float | None) -> dict:
        text = self.server.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
