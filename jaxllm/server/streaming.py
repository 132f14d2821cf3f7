"""Server-sent events: the streaming response that aborts on a disconnect, the event
encoding, and the pieces both streaming routes share (merging the streams of several
results, usage, which choices have news)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse

from jaxllm.executor.result import GenerationResult
from jaxllm.outputs import CompletionOutput, RequestOutput

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = "data: [DONE]\n\n"


class DisconnectAwareStreamingResponse(StreamingResponse):
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
                    except OSError:  # the client is gone, or too slow (guard.SlowClient)
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


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def has_news(c: CompletionOutput, index: int, ended: set[int], with_logprobs: bool) -> bool:
    """Whether a streamed choice has anything to send (its finish is sent exactly once)."""
    if c.finish_reason is not None:
        if index in ended:
            return False
        ended.add(index)
        return True
    return bool(c.text_diff) or (with_logprobs and bool(c.token_ids_diff))


async def merge_streams(results: list[GenerationResult]) -> AsyncIterator[tuple[int, RequestOutput]]:
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
