"""`n > 1` through the disaggregated router: one context + generation request per sequence,
the answers merged into the one the client asked for.

An aggregated server runs `n` sequences of a request as `n` engine requests, sequence `i`
seeded with `sequence_seed(seed, i)`; the router sends `n` disaggregated requests with
`n: 1` and those same seeds, so every sequence is the one aggregated serving gives (sampling
folds the output index into the key, and the generation worker continues at index 1). The
merged answer numbers the choices 0..n-1 and counts the prompt once in `usage`; a stream
relays every sequence's events as they come, re-numbered, with one usage chunk at the end.
`best_of > n` needs every sequence's cumulative logprob to rank them and beam search keeps
its beams in one engine: both are refused here.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import httpx
from fastapi.responses import Response, StreamingResponse

from jaxllm.sampling import sequence_seed
from jaxllm.server.errors import APIError
from jaxllm.server.streaming import SSE_DONE, SSE_HEADERS, sse


@dataclass
class Answer:
    """One sequence's answer before it is sent: a JSON body (`content`, with its status), the
    events of a stream the context worker answered alone, or a generation worker's open
    stream (the worker, and the response)."""

    status: int
    content: bytes
    events: Optional[list[str]] = None
    upstream: Optional[tuple[Any, httpx.Response]] = None


class SequenceRouter(Protocol):
    async def route_one(self, path: str, body: dict) -> Answer: ...

    def respond(self, answer: Answer) -> Response: ...

    async def discard(self, answer: Answer) -> None: ...

    def relay(self, worker: Any, upstream: httpx.Response) -> AsyncIterator[bytes]: ...


def num_sequences(body: dict) -> int:
    """The request's `n` (1 when unset or not a positive integer: the workers name the error)."""
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


async def route_sequences(router: SequenceRouter, path: str, body: dict) -> Response:
    """Answer an n > 1 request with one disaggregated request per sequence."""
    n = num_sequences(body)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise APIError(400, "best_of must equal n (or be unset) with disaggregated serving", "best_of")
    if body.get("use_beam_search"):
        raise APIError(400, "beam search is not supported with disaggregated serving", "use_beam_search")
    seed = body.get("seed")
    bodies = []
    for i in range(n):
        sub = dict(body, n=1)
        sub.pop("best_of", None)
        if isinstance(seed, int) and not isinstance(seed, bool):
            sub["seed"] = sequence_seed(seed, i)
        bodies.append(sub)
    results = await asyncio.gather(*(router.route_one(path, sub) for sub in bodies), return_exceptions=True)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    failed = failed or next((r for r in results if isinstance(r, Answer) and r.status != 200), None)
    answers = [r for r in results if isinstance(r, Answer)]
    if failed is not None:
        for answer in answers:
            if answer is not failed:
                await router.discard(answer)
        if isinstance(failed, BaseException):
            raise failed
        return router.respond(failed)
    if body.get("stream"):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(
            _merged_events(router, answers, include_usage), media_type="text/event-stream", headers=SSE_HEADERS
        )
    merged: dict = {}
    for i, answer in enumerate(answers):
        one = json.loads(answer.content)
        choices = one.get("choices") or []
        for choice in choices:
            choice["index"] = i
        if not merged:
            merged = dict(one, choices=choices)
        else:
            merged["choices"].extend(choices)
            _add_usage(merged, one.get("usage"))
    return Response(json.dumps(merged), media_type="application/json")


def _add_usage(merged: dict, usage: Optional[dict]) -> None:
    """Count another sequence's completion tokens (the prompt is counted once)."""
    if not usage:
        return
    total = merged.setdefault("usage", dict(usage, completion_tokens=0))
    total["completion_tokens"] = total.get("completion_tokens", 0) + usage.get("completion_tokens", 0)
    total["total_tokens"] = total.get("prompt_tokens", 0) + total["completion_tokens"]


async def _events_of(router: SequenceRouter, answer: Answer) -> AsyncIterator[str]:
    """One sequence's SSE events' data (without [DONE])."""
    if answer.events is not None:
        for event in answer.events:
            yield event
        return
    assert answer.upstream is not None
    pending = b""
    async with aclosing(router.relay(*answer.upstream)) as chunks:
        async for chunk in chunks:
            pending += chunk
            *events, pending = pending.split(b"\n\n")
            for event in events:
                yield event.decode() + "\n\n"


async def _merged_events(router: SequenceRouter, answers: list[Answer], include_usage: bool) -> AsyncIterator[str]:
    """Every sequence's events as they come, their choices re-numbered; one usage chunk."""
    queue: asyncio.Queue = asyncio.Queue()
    usage: dict = {}
    ids: list = []  # the first sequence's id names every chunk, as one aggregated stream's

    async def pump(index: int, answer: Answer) -> None:
        try:
            async for event in _events_of(router, answer):
                data = event.strip().removeprefix("data: ")
                if data == "[DONE]":
                    continue
                obj = json.loads(data)
                if "choices" in obj and not obj["choices"] and "usage" in obj:
                    if not usage:
                        usage.update(obj, id=ids[0] if ids else obj.get("id"))
                        usage["usage"] = dict(obj["usage"], completion_tokens=0)
                    _add_usage(usage, obj["usage"])
                    continue
                for choice in obj.get("choices") or []:
                    choice["index"] = index
                if "id" in obj:
                    ids[:] = ids or [obj["id"]]
                    obj["id"] = ids[0]
                await queue.put(sse(obj))
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(i, a)) for i, a in enumerate(answers)]
    try:
        done = 0
        while done < len(tasks):
            item = await queue.get()
            if item is None:
                done += 1
            else:
                yield item
        if include_usage and usage:
            yield sse(usage)
        yield SSE_DONE
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
