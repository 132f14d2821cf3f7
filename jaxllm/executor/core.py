"""The engine thread: the only thread that touches `LLMEngine`.

Callers talk to it through a command queue and it answers through an event sink, so
nobody ever blocks the step loop. Each iteration drains commands (without waiting while
there is work), calls `engine.step()` - which dispatches step N+1 before reading back
step N, so the device always has the next step queued - and hands the token events of
the step to the output side in one batch (the plain decode rows of a step as one event). The
loop adds no device syncs of its own.
"""

from __future__ import annotations

import heapq
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from jaxllm.executor.output_processor import ADD, DECODED, ERROR, TOKENS, OutputSpec, portable_error
from jaxllm.outputs import SpeculativeDecodingMetrics

logger = logging.getLogger(__name__)

FATAL = 3  # (FATAL, None, exception): the engine failed; every request fails with it
SHUTDOWN_EVENT = None  # the last item the sink receives


@dataclass
class SequenceRequest:
    """One engine request: a single sequence of a (possibly n > 1) generation request."""

    rid: int
    prompt_token_ids: list[int]
    sampling_params: Any
    spec: OutputSpec
    priority: float = 0.0
    arrival_time: Optional[float] = None
    deadline: Optional[float] = None  # time.monotonic() after which it finishes with 'timeout'
    lora_request: Any = None  # the LoRA adapter (a jaxllm.LoRARequest), None for the base model
    kv_cache_retention_config: Any = None
    # Beam search: ids of outputs 1..n-1 (this request gives output 0); they get their
    # tokens from this request's final update and finish with it.
    beam_siblings: tuple[int, ...] = ()
    # What admission made of the request (`jaxllm.engine.admission.AdmittedRequest`), checked
    # by the executor at submission; the engine admits it without checking it again.
    admitted: Any = None
    disaggregated_params: Any = None  # a context-only or generation-only request (jaxllm.DisaggregatedParams)


@dataclass
class LoopTiming:
    """Where the engine thread's time goes (for the host-overhead benchmark)."""

    iterations: int = 0
    step_seconds: float = 0.0
    loop_seconds: float = 0.0
    events: int = 0

    def as_dict(self) -> dict:
        it = max(self.iterations, 1)
        return {
            "iterations": self.iterations,
            "mean_step_ms": self.step_seconds / it * 1e3,
            "mean_iteration_ms": self.loop_seconds / it * 1e3,
            "mean_outside_step_ms": (self.loop_seconds - self.step_seconds) / it * 1e3,
        }


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    error: Optional[BaseException] = None


def _logits_outputs(request: Any) -> Optional[dict]:
    """The finished request's logits outputs (jaxllm.engine.logits_outputs), if it asked, and
    its `speculative_decoding` metrics, if it drafted."""
    record = getattr(request, "logits_record", None)
    outputs = {} if record is None else record.outputs(request.sampling_params, len(request.output_token_ids))
    drafted = getattr(request, "num_draft_tokens", 0)
    if drafted:
        outputs = dict(outputs or {})
        outputs["speculative_decoding"] = SpeculativeDecodingMetrics(drafted, request.num_accepted_draft_tokens)
    return outputs or None


class EngineCore:
    """Runs schedule -> step -> respond on a background thread."""

    # Seconds without a request before the engine's idle work starts (a caller that builds an
    # engine and submits at once finds the cores free).
    IDLE_SECONDS = 2.0

    def __init__(
        self,
        engine: Any,
        sink: Callable[[Optional[list]], None],
        on_stats: Optional[Callable[[dict], None]] = None,
        *,
        name: str = "jaxllm-engine",
    ) -> None:
        self.engine = engine
        self._sink = sink
        self._on_stats = on_stats
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._accepting = True
        self._deadlines: list[tuple[float, int]] = []
        # Sequences whose output nobody watches while it grows (no streaming, no stop strings):
        # rid -> logprobs gathered so far (None when not requested).
        self._quiet: dict[int, Optional[list]] = {}
        self._siblings: dict[int, tuple[int, ...]] = {}  # beam-search request -> its other outputs' ids
        self.timing = LoopTiming()
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ commands (any thread)
    def _put(self, command: tuple) -> None:
        with self._lock:
            if not self._accepting:
                raise RuntimeError(
                    "the executor is shut down"
                    if self.error is None
                    else f"the executor failed and is shut down: {self.error!r}"
                )
            self._commands.put(command)

    def add(self, requests: list[SequenceRequest]) -> None:
        self._put(("add", requests))

    def abort(self, rids: list[int], reason: str = "cancelled") -> None:
        try:
            self._put(("abort", rids, reason))
        except RuntimeError:
            pass  # shutting down: every request is being cancelled anyway

    def call(self, fn: Callable[[Any], Any], timeout: Optional[float] = None) -> Any:
        """Run `fn(engine)` on the engine thread between steps and return its value."""
        call = _Call(fn)
        self._put(("call", call))
        if not call.done.wait(timeout):
            raise TimeoutError(f"the engine thread did not answer within {timeout}s")
        if call.error is not None:
            raise call.error
        return call.value

    def stop(self) -> None:
        """Cancel every request, free their blocks and end the thread (idempotent)."""
        with self._lock:
            if self._accepting:
                self._accepting = False
                self._commands.put(("stop",))

    def join(self, timeout: Optional[float] = None) -> None:
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------------------ the loop (engine thread)
    def _run(self) -> None:
        engine = self.engine
        stopping = False
        try:
            while not stopping:
                started = time.perf_counter()
                events: list[tuple] = []
                busy = engine.has_unfinished_requests()
                for command in self._drain(block=not busy):
                    stopping |= self._handle(command, events)
                if stopping:
                    self._cancel_all(events)
                    self._sink(events)
                    break
                if self._deadlines:
                    self._expire(events)
                if engine.has_unfinished_requests():
                    iteration = engine.iteration
                    step_started = time.perf_counter()
                    updates = engine.step()
                    if not engine.active and engine.has_unfinished_requests():
                        # Only a step of already finished requests is in flight: read it back now,
                        # so that a caller who sees the last result finish finds the engine idle.
                        updates += engine.step()
                    self.timing.step_seconds += time.perf_counter() - step_started
                    self.timing.iterations += 1
                    quiet = self._quiet
                    for decoded in updates.decoded:
                        # Plain decode rows: one event for all of them (the output side skips
                        # the sequences nobody watches, like `quiet` here).
                        events.append((DECODED, decoded.request_ids, decoded.token_ids))
                    for u in updates.updates:
                        request = u.request
                        rid = request.request_id
                        if u.error is not None:  # the engine failed this request alone
                            quiet.pop(rid, None)
                            self._siblings.pop(rid, None)
                            events.append((ERROR, rid, RuntimeError(u.error)))
                        elif u.beam_outputs is not None:
                            events += self._beam_events(rid, u.beam_outputs)
                        elif rid in quiet:
                            if u.new_logprobs and quiet[rid] is not None:
                                quiet[rid].extend(u.new_logprobs)
                            if u.finished:
                                events.extend(
                                    self._final_events(
                                        rid, request, request.finish_reason, getattr(request, "stop_reason", None)
                                    )
                                )
                        elif u.finished:
                            events.append(
                                (
                                    TOKENS,
                                    rid,
                                    u.new_token_ids,
                                    u.new_logprobs or None,
                                    request.finish_reason,
                                    getattr(request, "stop_reason", None),
                                    None,
                                    _logits_outputs(request),
                                )
                            )
                        else:
                            events.append((TOKENS, rid, u.new_token_ids, u.new_logprobs or None, None, None))
                    if self._on_stats is not None and engine.iteration != iteration and engine.iteration_stats:
                        self._on_stats(engine.iteration_stats[-1])
                    if not updates and engine.iteration == iteration:
                        time.sleep(0.0005)  # nothing could be scheduled: do not spin hot
                if events:
                    self.timing.events += len(events)
                    self._sink(events)
                self.timing.loop_seconds += time.perf_counter() - started
        except BaseException as exc:  # the engine is in an unknown state: fail everything
            logger.exception("engine thread failed")
            self.error = exc
            self._sink([(FATAL, None, portable_error(exc))])
        finally:
            with self._lock:
                self._accepting = False
            self._fail_leftover_commands()
            self._sink(SHUTDOWN_EVENT)

    def _drain(self, block: bool) -> list[tuple]:
        commands = []
        try:
            if block:
                commands.append(self._wait_for_command())
            else:
                commands.append(self._commands.get_nowait())
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            pass
        return commands

    def _wait_for_command(self) -> tuple:
        """The next command; when none comes for `IDLE_SECONDS`, the engine's idle work
        (`LLMEngine.on_idle`: programs a background warm-up left for idle time) starts first."""
        try:
            return self._commands.get(timeout=self.IDLE_SECONDS)
        except queue.Empty:
            on_idle = getattr(self.engine, "on_idle", None)
            if on_idle is not None:
                try:
                    on_idle()
                except Exception:  # idle work is optional: the engine serves on without it
                    logger.warning("the engine's idle work failed", exc_info=True)
            return self._commands.get()

    def _handle(self, command: tuple, events: list[tuple]) -> bool:
        kind = command[0]
        if kind == "add":
            for seq in command[1]:
                events.append((ADD, seq.rid, seq.spec))
                extra = {} if seq.lora_request is None else {"lora_request": seq.lora_request}
                if seq.kv_cache_retention_config is not None:
                    extra["kv_cache_retention_config"] = seq.kv_cache_retention_config
                if seq.admitted is not None:
                    extra["admitted"] = seq.admitted
                if seq.disaggregated_params is not None:
                    extra["disaggregated_params"] = seq.disaggregated_params
                events += [(ADD, sibling, seq.spec) for sibling in seq.beam_siblings]
                try:
                    self.engine.add_request(
                        seq.prompt_token_ids,
                        seq.sampling_params,
                        request_id=seq.rid,
                        priority=seq.priority,
                        arrival_time=seq.arrival_time,
                        **extra,
                    )
                except Exception as exc:  # refused: this request fails, the others go on
                    events.append((ERROR, seq.rid, portable_error(exc)))
                    continue
                if seq.sampling_params.use_beam_search:
                    # Beams change until the end: only the final beams are sent (streaming too).
                    self._siblings[seq.rid] = tuple(seq.beam_siblings)
                    self._quiet[seq.rid] = None
                    if seq.deadline is not None:
                        heapq.heappush(self._deadlines, (seq.deadline, seq.rid))
                    continue
                if seq.deadline is not None:
                    heapq.heappush(self._deadlines, (seq.deadline, seq.rid))
                if seq.spec.quiet:  # nobody looks at its partial output: its tokens go once, when it ends
                    self._quiet[seq.rid] = [] if seq.spec.return_logprobs else None
        elif kind == "abort":
            reason = command[2]
            for rid in command[1]:
                request = self.engine.abort_request(rid)
                if request is not None:
                    events.extend(self._final_events(rid, request, reason, None))
        elif kind == "call":
            call = command[1]
            try:
                call.value = call.fn(self.engine)
            except BaseException as exc:
                call.error = exc
            call.done.set()
        elif kind == "stop":
            return True
        return False

    def _expire(self, events: list[tuple]) -> None:
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid = heapq.heappop(self._deadlines)
            request = self.engine.abort_request(rid)
            if request is not None:
                events.extend(self._final_events(rid, request, "timeout", None))

    def _cancel_all(self, events: list[tuple]) -> None:
        engine = self.engine
        for rid in list(engine.active):
            request = engine.abort_request(rid)
            if request is not None:
                events.extend(self._final_events(rid, request, "cancelled", None))
        # Read back the step still in flight so nothing refers to the freed blocks.
        for _ in range(4):
            if not engine.has_unfinished_requests():
                break
            engine.step()

    def _beam_events(self, rid: int, beams: list) -> list[tuple]:
        """The final events of a beam-search request: output i is the i-th best beam."""
        self._quiet.pop(rid, None)
        rids = (rid,) + self._siblings.pop(rid, ())
        events = [(TOKENS, r, list(b.token_ids), None, b.finish_reason, None, b.score) for r, b in zip(rids, beams)]
        # Fewer finished beams than outputs (cannot happen with n <= beam width): empty outputs.
        events += [(TOKENS, r, [], None, "length", None) for r in rids[len(beams) :]]
        return events

    def _final_events(self, rid: int, request: Any, reason: Optional[str], stop_reason) -> list[tuple]:
        """The last event of a sequence, and of the other outputs of a beam-search request
        that ended early (aborted, timed out: they end empty)."""
        siblings = self._siblings.pop(rid, ())
        return [self._final_event(rid, request, reason, stop_reason)] + [
            (TOKENS, r, [], None, reason, None) for r in siblings
        ]

    def _final_event(self, rid: int, request: Any, reason: Optional[str], stop_reason) -> tuple:
        """The last event of a sequence; a quiet one carries all its tokens (and logprobs) here,
        and any sequence the logits outputs it asked for."""
        if rid in self._quiet:
            logprobs = self._quiet.pop(rid)
            return (
                TOKENS,
                rid,
                list(request.output_token_ids),
                logprobs or None,
                reason,
                stop_reason,
                None,
                _logits_outputs(request),
            )
        return (TOKENS, rid, [], None, reason, stop_reason, None, _logits_outputs(request))

    def _fail_leftover_commands(self) -> None:
        error = self.error
        events = []
        for command in self._drain(block=False):
            if command[0] == "add":
                for seq in command[1]:
                    events.append((ADD, seq.rid, seq.spec))
                    events.append((ERROR, seq.rid, error or RuntimeError("the executor is shut down")))
            elif command[0] == "call":
                command[1].error = error or RuntimeError("the executor is shut down")
                command[1].done.set()
        if events:
            self._sink(events)
