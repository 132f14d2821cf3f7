"""`GenerationResult`: the caller's handle on one submitted request.

The executor's output thread pushes deltas in; the caller pulls them out, from a thread
(`result()`, `for out in result`) or a coroutine (`await aresult()`, `async for`). Deltas
that arrive while the caller is busy are merged into the next update, so a slow
consumer sees fewer, larger diffs and never slows the engine down.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Optional, Protocol

from jaxllm.executor.generation_request import GenerationRequest
from jaxllm.executor.output_processor import Delta
from jaxllm.outputs import CompletionOutput, RequestOutput


class RequestAborter(Protocol):
    """What a result needs of its executor: a way to cancel its request."""

    def abort_request(self, request_id: int) -> None: ...


def _set_done(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _set_all_done(futures: list[asyncio.Future]) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)


Wakeups = dict  # event loop -> futures to complete there; lets a producer wake many results at once


def wake(wakeups: Wakeups) -> None:
    """Complete the collected futures with one thread-safe call per event loop."""
    for loop, futures in wakeups.items():
        try:
            loop.call_soon_threadsafe(_set_all_done, futures)
        except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
            pass


class GenerationResult:
    """A future for one request's `RequestOutput`, and a stream of its updates."""

    def __init__(self, request: GenerationRequest, aborter: Optional[RequestAborter] = None) -> None:
        self.request = request
        self._aborter = aborter
        params = request.sampling_params
        self._num_seqs = request.num_sequences
        self._n = params.n
        self._want_logprobs = params.logprobs is not None
        self._want_scores = self._want_logprobs or params.use_beam_search  # a beam's score is its cumulative logprob
        self._outputs = [
            CompletionOutput(index=i, logprobs=[] if self._want_logprobs else None) for i in range(self._num_seqs)
        ]
        self._context_logits = None  # set from the final delta when return_context_logits
        # Producer side (output thread), guarded by _cond.
        self._cond = threading.Condition(threading.Lock())
        self._inbox: list[tuple[int, Delta]] = []
        self._open_seqs = self._num_seqs
        self._error: Optional[BaseException] = None
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        # Consumer side.
        self._finished = False
        self._final: Optional[RequestOutput] = None
        self._consumer_lock = threading.Lock()
        self.finished_at: Optional[float] = None
        self.first_token_at: Optional[float] = None  # time.monotonic() of the first generated token
        # Set by the executor (`attach`): the engine request ids of the sequences, and how many
        # of them the executor still routes deltas to (guarded by the executor's lock).
        self._rids: tuple[int, ...] = ()
        self._open_children = 0

    # ------------------------------------------------------------------ fields
    @property
    def request_id(self) -> int:
        return self.request.id

    @property
    def prompt(self) -> Optional[str]:
        return self.request.prompt

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def streaming(self) -> bool:
        return self.request.streaming

    @property
    def outputs(self) -> list[CompletionOutput]:
        """The outputs as seen by the caller so far (the n best once finished)."""
        return self._final.outputs if self._final is not None else self._outputs[: self._n]

    @property
    def finished(self) -> bool:
        return self._finished

    # ------------------------------------------------------------------ executor bookkeeping
    def attach(self, engine_request_ids: list[int]) -> None:
        """Record the engine requests this result gathers (one per sequence, or the one beam
        search request and its siblings' ids)."""
        self._rids = tuple(engine_request_ids)
        self._open_children = len(self._rids)

    @property
    def engine_request_ids(self) -> tuple[int, ...]:
        return self._rids

    def child_finished(self) -> bool:
        """One engine request finished; True when it was the last one still open."""
        self._open_children -= 1
        return self._open_children == 0

    # ------------------------------------------------------------------ producer side
    def push(self, items: list[tuple[int, Delta]], wakeups: Optional[Wakeups] = None) -> None:
        """Add deltas. With `wakeups`, async waiters are collected there instead of woken one by one."""
        with self._cond:
            if self.first_token_at is None and any(d.token_ids for _, d in items):
                self.first_token_at = time.monotonic()
            self._inbox.extend(items)
            self._open_seqs -= sum(1 for _, d in items if d.finish_reason is not None)
            self._notify_locked(wakeups)

    def fail(self, error: BaseException) -> None:
        """The request failed: waiters get `error` (ignored once every sequence has ended)."""
        with self._cond:
            if self._error is None and self._open_seqs > 0:
                self._error = error
                self._notify_locked()

    @property
    def _producer_done(self) -> bool:
        return self._open_seqs <= 0 or self._error is not None

    def _notify_locked(self, wakeups: Optional[Wakeups] = None) -> None:
        if self._producer_done:
            self.finished_at = time.monotonic()
        self._cond.notify_all()
        if not self._async_waiters:
            return
        waiters, self._async_waiters = self._async_waiters, []
        if wakeups is not None:
            for loop, future in waiters:
                wakeups.setdefault(loop, []).append(future)
            return
        for loop, future in waiters:
            try:
                loop.call_soon_threadsafe(_set_done, future)
            except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
                pass

    # ------------------------------------------------------------------ consumer side
    def _take_locked(self) -> tuple[list[tuple[int, Delta]], bool]:
        items, self._inbox = self._inbox, []
        return items, self._producer_done

    def _merge(self, items: list[tuple[int, Delta]], done: bool) -> Optional[RequestOutput]:
        """Fold deltas into the outputs; returns the update to hand out (None if nothing new)."""
        with self._consumer_lock:
            if self._finished:
                return None
            if self._error is not None and done:
                raise self._error
            for out in self._outputs:
                out.text_diff = ""
                out.token_ids_diff = []
                out.logprobs_diff = [] if out.logprobs is not None else None
            for index, delta in items:
                out = self._outputs[index]
                out.token_ids.extend(delta.token_ids)
                out.token_ids_diff.extend(delta.token_ids)
                out.text += delta.text
                out.text_diff += delta.text
                if delta.logprobs is not None and out.logprobs is not None:
                    out.logprobs.extend(delta.logprobs)
                    out.logprobs_diff.extend(delta.logprobs)
                if delta.cumulative_logprob is not None:
                    out.cumulative_logprob = delta.cumulative_logprob
                if delta.finish_reason is not None:
                    out.finish_reason = delta.finish_reason
                    out.stop_reason = delta.stop_reason
                if delta.logits_outputs:
                    out.generation_logits = delta.logits_outputs.get("generation_logits")
                    out.prompt_logprobs = delta.logits_outputs.get("prompt_logprobs")
                    out.speculative_decoding = delta.logits_outputs.get("speculative_decoding")
                    if self._context_logits is None:  # the same prompt for every sequence
                        self._context_logits = delta.logits_outputs.get("context_logits")
            if done:
                self._finished = True
                self._final = self._snapshot(final=True)
                return self._final
            if not items:
                return None
            return self._snapshot(final=False)

    def _snapshot(self, final: bool) -> RequestOutput:
        outputs = self._outputs
        if final and self._num_seqs > self._n:
            # best_of: keep the n sequences with the highest cumulative logprob.
            outputs = sorted(outputs, key=lambda o: o.cumulative_logprob or 0.0, reverse=True)[: self._n]
            outputs = [replace(o, index=i) for i, o in enumerate(outputs)]
            if not self._want_logprobs:
                for o in outputs:
                    o.logprobs = o.logprobs_diff = None
                    o.cumulative_logprob = None
        else:
            outputs = outputs[: self._n]
            if not self._want_scores:
                for o in outputs:
                    o.cumulative_logprob = None
        copies = [
            CompletionOutput(
                index=o.index,
                text=o.text,
                token_ids=list(o.token_ids),
                cumulative_logprob=o.cumulative_logprob,
                logprobs=None if o.logprobs is None else list(o.logprobs),
                finish_reason=o.finish_reason,
                stop_reason=o.stop_reason,
                text_diff=o.text_diff,
                token_ids_diff=o.token_ids_diff,
                logprobs_diff=o.logprobs_diff,
                generation_logits=o.generation_logits,
                prompt_logprobs=o.prompt_logprobs,
                speculative_decoding=o.speculative_decoding,
            )
            for o in outputs
        ]
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            copies,
            finished=final,
            context_logits=self._context_logits,
            prompt_logprobs=copies[0].prompt_logprobs if copies else None,
        )

    def _next_blocking(self, timeout: Optional[float]) -> Optional[RequestOutput]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                while not self._inbox and not self._producer_done:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"request {self.request_id} did not finish within {timeout}s")
                    self._cond.wait(remaining)
                items, done = self._take_locked()
            update = self._merge(items, done)
            if update is not None or self._finished:
                return update

    async def _next_async(self) -> Optional[RequestOutput]:
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if not self._inbox and not self._producer_done:
                    future = loop.create_future()
                    self._async_waiters.append((loop, future))
                else:
                    future = None
                    items, done = self._take_locked()
            if future is not None:
                try:
                    await future
                except asyncio.CancelledError:
                    with self._cond:
                        self._async_waiters = [w for w in self._async_waiters if w[1] is not future]
                    raise
                continue
            update = self._merge(items, done)
            if update is not None or self._finished:
                return update

    # ------------------------------------------------------------------ public API
    def result(self, timeout: Optional[float] = None) -> RequestOutput:
        """Block until the request finishes; TimeoutError after `timeout` seconds (the request goes on)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._finished:
            self._next_blocking(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self._final

    async def aresult(self, timeout: Optional[float] = None) -> RequestOutput:
        """Await the final output. A cancelled caller aborts the request (nobody is left to read
        it); `timeout` raises TimeoutError and, as with `result`, the request goes on."""
        try:
            if timeout is None:
                await self._wait_finished()
            else:
                await asyncio.wait_for(self._wait_finished(), timeout)
        except asyncio.CancelledError:
            self.abort()
            raise
        return self._final

    async def _wait_finished(self) -> None:
        while not self._finished:
            await self._next_async()

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self._finished:
            update = self._next_blocking(None)
            if update is not None and (self.streaming or update.finished):
                yield update

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Stream the updates. If the consuming task is cancelled, or the loop is left early and
        the iterator closed (`aclose`, or garbage collection), the request is aborted."""
        try:
            while not self._finished:
                update = await self._next_async()
                if update is not None and (self.streaming or update.finished):
                    yield update
        except (asyncio.CancelledError, GeneratorExit):
            self.abort()
            raise

    def abort(self) -> None:
        """Stop generating; the result finishes with 'cancelled' and keeps what it has."""
        if self._aborter is not None and not self._finished:
            self._aborter.abort_request(self.request_id)

    def __repr__(self) -> str:
        return f"GenerationResult(request_id={self.request_id}, finished={self._finished}, outputs={self.outputs!r})"
