"""Which token bucket a step runs in while the engine still compiles its programs.

Without a warm-up (`LLM.generate` on a fresh engine) every token bucket used to compile the
first time a step needed it, on the step loop, one after another: on a CPU most of a first
`generate` was compiling. Instead, a step whose best-fitting bucket (the smallest holding its
tokens) is not compiled runs in the smallest *compiled* bucket that holds it, padded (the
padding is masked, as in any bucket). A step waits for a compile only when no compiled bucket
holds its tokens (the first step, or one larger than any before).

When the best fit is compiled is a rent-or-buy choice: padding costs a little on every step,
compiling costs once, and on a CPU the compile takes the cores the steps run on. So a bucket
compiles on the runner's compile threads once the steps that wanted it have spent as much wall
time as a compile takes (the mean of those so far), or as soon as the engine is idle. That holds
for a background warm-up's buckets too: it compiles the buckets a lone user needs first and
`defer`s the others to the engine's idle time (or to the steps that pay for them).

A second compiler of the same kind keeps the small decode buckets (`sizes`: row counts, see
`EngineConfig.decode_batch_sizes`): a decode step whose best decode bucket is not compiled runs
in the smallest compiled decode bucket holding it, or, when none does, in a token bucket
(`choose` returns None), which a warm-up always compiles. At most `max_in_flight` buckets
compile at once, in the background of `jaxllm.engine.background_compiles` (on a CPU, once no
engine of the process is busy). While a token bucket larger than every compiled one is not
compiled, `token_budget` caps a step's tokens at the largest compiled bucket (a longer prompt runs in
chunks), so no step waits for a compile once a warm-up compiled the decode bucket; steps held
to the cap pay toward the next bucket up. Programs compiled this way are the same programs,
under the same persistent-cache keys, as a warm-up's. Padding changes the float rounding of a
step's matmuls (not which tokens are valid), as batching with other requests does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Optional

from jaxllm.batch_builder import choose_decode_rows, choose_token_bucket

logger = logging.getLogger(__name__)


class StepClock:
    """Wall time since the previous step, shared by an engine's compilers (token and decode
    buckets), so a step that asked only one of them still counts for the other's next step."""

    # A gap between two steps longer than this is idle time, not time spent on a padded step.
    MAX_STEP_SECONDS = 1.0

    def __init__(self) -> None:
        self._last: Optional[float] = None

    def tick(self) -> float:
        now = time.perf_counter()
        seconds = 0.0 if self._last is None else min(now - self._last, self.MAX_STEP_SECONDS)
        self._last = now
        return seconds


class BucketCompiler:
    def __init__(
        self,
        *,
        max_num_tokens: int,
        min_token_bucket: int,
        compile_bucket: Callable[[int, bool], Future],
        compile_seconds: Callable[[], float],
        max_in_flight: int = 1,
        sizes: Optional[list[int]] = None,
        clock: Optional[StepClock] = None,
        min_budget: int = 1,
    ) -> None:
        """`compile_bucket(bucket, idle)` starts compiling the forward of a bucket in the
        background (`idle`: for idle time, not paid by steps) and returns its future;
        `compile_seconds()` is what one compile is expected to take (the mean so far).
        `sizes`: the buckets (ascending) when they are the decode buckets rather than the token
        buckets; `clock`: the step clock it shares with the engine's other compiler;
        `min_budget`: the smallest token budget a step can run with (a KV block: prompt chunks
        are whole blocks), below which `token_budget` caps nothing."""
        self.min_budget = min_budget
        self.sizes = sizes
        self.max_num_tokens = max_num_tokens
        self.min_token_bucket = min_token_bucket
        self._compile_bucket = compile_bucket
        self._compile_seconds = compile_seconds
        self.max_in_flight = max(1, max_in_flight)
        self._lock = threading.Lock()
        self._ready: list[int] = []  # compiled buckets, ascending
        # Buckets steps wanted, with the wall time of those padded steps, until it pays a compile.
        self._asked: dict[int, float] = {}
        self._clock = StepClock() if clock is None else clock
        self._wanted: list[int] = []  # buckets to compile, not started yet (first come, first started)
        self._deferred: list[int] = []  # buckets to compile once the engine is idle (a background warm-up's)
        self._in_flight: set[int] = set()
        self._idle: set[int] = set()  # wanted for idle time, not paid for by steps
        self._cap: Optional[int] = None  # the token budget of the step being planned (`token_budget`)
        self._closed = False
        self._failed: set[int] = set()  # compiled ahead with an error: the step compiles it (and reports)
        self.padded_steps = 0  # steps run in a larger bucket than their best fit

    @property
    def ready(self) -> list[int]:
        with self._lock:
            return list(self._ready)

    def mark_ready(self, buckets: Any) -> None:
        """Buckets compiled by someone else (the warm-up, or a step that compiled its own)."""
        with self._lock:
            for bucket in buckets:
                self._add_ready(bucket)

    def _add_ready(self, bucket: int) -> None:
        if bucket not in self._ready:
            self._ready.append(bucket)
            self._ready.sort()
        if bucket in self._wanted:
            self._wanted.remove(bucket)
        if bucket in self._deferred:
            self._deferred.remove(bucket)
        self._asked.pop(bucket, None)

    @property
    def num_waiting(self) -> int:
        """Buckets to compile that have not started: deferred to idle time, or wanted."""
        with self._lock:
            return len(self._deferred) + len(self._wanted)

    @property
    def deferred(self) -> list[int]:
        with self._lock:
            return list(self._deferred)

    def defer(self, buckets: Any) -> None:
        """Compile `buckets` once the engine is idle, in this order, unless steps pay for one
        first (a background warm-up's remaining buckets)."""
        with self._lock:
            for bucket in buckets:
                if (
                    bucket not in self._ready
                    and bucket not in self._in_flight
                    and bucket not in self._wanted
                    and bucket not in self._deferred
                ):
                    self._deferred.append(bucket)

    def token_budget(self) -> Optional[int]:
        """The most tokens a step may take now: the largest compiled token bucket while a larger
        one is not compiled (None: no cap, `max_num_tokens`; also before any bucket is compiled)."""
        cap = None
        if self.sizes is None:
            largest = choose_token_bucket(self.max_num_tokens, self.max_num_tokens, self.min_token_bucket)
            with self._lock:
                ready = self._ready
                if ready and self.min_budget <= ready[-1] < largest and largest not in self._failed:
                    cap = ready[-1]
        self._cap = cap
        return cap

    def _above(self, bucket: int) -> int:
        """The token bucket after `bucket`."""
        return choose_token_bucket(bucket + 1, self.max_num_tokens, self.min_token_bucket)

    def choose(self, num_tokens: int) -> int:
        """The bucket a step of `num_tokens` tokens runs in (see the module docstring)."""
        bucket = self._choose(num_tokens)
        if bucket is None:
            raise AssertionError("a token bucket compiler always has a bucket")
        return bucket

    def choose_decode(self, num_rows: int) -> Optional[int]:
        """The decode bucket a decode step of `num_rows` rows runs in; None: a token bucket."""
        return self._choose(num_rows)

    def _choose(self, num_tokens: int) -> Optional[int]:
        if self.sizes is None:
            best = choose_token_bucket(num_tokens, self.max_num_tokens, self.min_token_bucket)
        else:
            best = choose_decode_rows(num_tokens, self.sizes)
            if best is None:
                return None
        step_seconds = self._clock.tick()
        with self._lock:
            ready = self._ready
            if best in ready or best in self._failed:
                fitting = best
                # A step held to the token cap pays toward the bucket that would lift it.
                cap = self._cap if self.sizes is None else None
                want = self._above(cap) if cap is not None and num_tokens >= cap else None
                if want is None or want in ready or want in self._failed:
                    return best
            else:
                fitting = next((b for b in ready if b >= num_tokens), None)
                if fitting is None and self.sizes is None:  # the step compiles `best` itself (or waits for it)
                    self._add_ready(best)
                    return best
                want = best
                self.padded_steps += fitting is not None
            if want not in self._in_flight and want not in self._wanted:
                paid = self._asked.get(want, 0.0) + step_seconds
                self._asked[want] = paid
                if paid >= self._compile_seconds():
                    del self._asked[want]
                    self._wanted.append(want)
                    self._idle.discard(want)
                    if want in self._deferred:
                        self._deferred.remove(want)
            to_start = self._take_startable()
        self._start(to_start)
        return fitting

    def on_idle(self) -> None:
        """The engine has nothing to run: compile every bucket steps asked for, then the deferred ones."""
        with self._lock:
            if not self._asked and not self._deferred:
                return
            for bucket in [*self._asked, *self._deferred]:
                if bucket not in self._wanted and bucket not in self._in_flight:
                    self._wanted.append(bucket)
                    self._idle.add(bucket)
            self._asked.clear()
            self._deferred.clear()
            to_start = self._take_startable()
        self._start(to_start)

    def close(self) -> None:
        """Start no more compiles (the engine is closing)."""
        with self._lock:
            self._closed = True
            self._wanted.clear()
            self._asked.clear()
            self._deferred.clear()

    def _take_startable(self) -> list[int]:
        started = []
        if self._closed:
            return started
        while self._wanted and len(self._in_flight) < self.max_in_flight:
            bucket = self._wanted.pop(0)
            self._in_flight.add(bucket)
            started.append(bucket)
        return started

    def _start(self, buckets: list[int]) -> None:
        for bucket in buckets:
            with self._lock:
                idle = bucket in self._idle
                self._idle.discard(bucket)
            try:
                future = self._compile_bucket(bucket, idle)
            except Exception as exc:  # closing, or exiting: a step that needs it compiles it
                logger.debug("could not start compiling token bucket %d ahead: %r", bucket, exc)
                self._done(bucket, None)
                continue
            future.add_done_callback(lambda f, bucket=bucket: self._done(bucket, f))

    def _done(self, bucket: int, future: Future | None) -> None:
        ok = future is not None and not future.cancelled() and future.exception() is None
        if future is not None and not ok and not future.cancelled() and not self._closed:
            logger.warning("compiling token bucket %d ahead failed: %r", bucket, future.exception())
        with self._lock:
            self._in_flight.discard(bucket)
            if ok:
                self._add_ready(bucket)
            else:
                self._failed.add(bucket)
            to_start = self._take_startable()
        self._start(to_start)


def engine_compilers(config: Any, planner: Any, step_runner: Any, runner: Any, sampler_variants: Any = None) -> tuple:
    """(token-bucket compiler, decode-bucket compiler or None) of an engine: `planner` builds the
    empty steps, `step_runner` compiles them, `runner` says what a compile takes;
    `sampler_variants` (`jaxllm.engine.sampler_variants`): a decode bucket is ready once its
    general sampler is compiled too."""
    clock = StepClock()

    def mean_compile_seconds() -> float:
        return runner.compile_seconds / max(1, runner.num_compiled_variants)

    tokens = BucketCompiler(
        max_num_tokens=config.max_num_tokens,
        min_token_bucket=config.min_token_bucket,
        compile_bucket=lambda bucket, idle: step_runner.compile_forward(
            *planner.empty_step(bucket), wait=False, background=True, idle=idle
        ),
        compile_seconds=mean_compile_seconds,
        max_in_flight=runner.compile_workers - 1,
        clock=clock,
        min_budget=planner.kv_cache_manager.tokens_per_block,
    )
    if not planner.decode_batch_sizes:
        return tokens, None

    def compile_rows(size: int, idle: bool) -> Future:
        forward = step_runner.compile_forward(*planner.empty_step(0, size), wait=False, background=True, idle=idle)
        return forward if sampler_variants is None else sampler_variants.with_general_sampler(forward, size, idle)

    rows = BucketCompiler(
        max_num_tokens=config.max_batch_size,
        min_token_bucket=1,
        compile_bucket=compile_rows,
        compile_seconds=mean_compile_seconds,
        max_in_flight=runner.compile_workers - 1,
        sizes=planner.decode_batch_sizes,
        clock=clock,
    )
    return tokens, rows


def cap_token_budget(scheduler: Any, cap: Optional[int]) -> None:
    """Hold the scheduler's steps to `cap` tokens (None: lift the cap), when it can be capped
    (the built-in micro-batch scheduler can)."""
    micro = getattr(scheduler, "micro_batch_scheduler", None)
    cap_tokens = getattr(micro, "cap_tokens", None)
    if cap_tokens is not None:
        cap_tokens(cap)
