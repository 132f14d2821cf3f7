"""Compiles that run beside the step loop, without taking the cores the steps need.

After "ready" every program a request can reach is compiled or has a compiled fallback (a
larger bucket, the general sampler variant: `jaxllm.engine.sampler_variants`), so a program
compiled later only makes steps cheaper. On a CPU backend the steps' XLA threads use every
core, so such compiles must not compete with them:

- they run on a bounded number of threads (`max_workers`, one by default), and XLA's compile,
  the part that takes the cores, on one thread whose OS priority is lowered (nice 19 through
  `os.setpriority` on the thread's native id, on Linux): it gets the cycles the steps leave
  idle. Tracing and lowering (Python, under the GIL) stay at the normal priority: a thread
  holding the GIL at a low priority would stall the step loop waiting for it;
- on a CPU backend a compile starts only once no engine of this process has been busy for
  `settle_seconds` (elsewhere a compile does not share the device): tracing and lowering a
  forward take the GIL in long stretches, and a compile takes a core, either of which stalls a
  running stream for a second or more on a small machine. Compiles that steps paid for (the
  rent-or-buy rule of `jaxllm.engine.compile_ahead`) go first; those queued as idle work (a
  background warm-up's remaining buckets, variants steps asked for without paying for them) are
  queued only once the engine's driver found it idle. An engine that is never idle would never
  get a paid compile (its steps stay held to the largest compiled token bucket), so a paid
  compile that has waited `max_hold_seconds` starts while engines are busy, one per
  `max_hold_seconds` at most: a stall of a second or so for the running streams, bounded.

A compile under way is never stopped (XLA cannot pause one); a step that needs a program still
queued here takes it over (`ProgramCache.get` cancels the queued task and compiles it itself).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

logger = logging.getLogger(__name__)

LOW_PRIORITY_NICE = 19
"""The niceness of background compile threads (the lowest priority on Linux)."""


class EngineActivity:
    """Whether an engine of this process is busy (has requests), and since when none is.

    Engines share the process's cores on a CPU backend, so one engine's idle time is not idle
    time for the machine while another engine of the same process runs steps."""

    def __init__(self) -> None:
        self._busy: weakref.WeakSet = weakref.WeakSet()  # an engine dropped while busy stops counting
        self._quiet_since = time.monotonic()
        self._changed = threading.Condition()

    def set_busy(self, owner: object, busy: bool) -> None:
        with self._changed:
            if busy:
                self._busy.add(owner)
            elif owner in self._busy:
                self._busy.discard(owner)
                if not self._busy:
                    self._quiet_since = time.monotonic()
                    self._changed.notify_all()

    def quiet_for(self) -> float:
        """Seconds since the last engine of this process went idle (0 while one is busy)."""
        with self._changed:
            return 0.0 if len(self._busy) else time.monotonic() - self._quiet_since

    def wait(self, seconds: float) -> None:
        """Sleep up to `seconds`, waking early when an engine goes idle."""
        with self._changed:
            self._changed.wait(seconds)


ACTIVITY = EngineActivity()
"""The process's engines (see `EngineActivity`)."""


def lower_thread_priority() -> None:
    """Lower this thread's OS priority (Linux: a thread's native id is a process id for
    setpriority); elsewhere, or when refused, nothing changes."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOW_PRIORITY_NICE)
    except (AttributeError, OSError) as exc:  # not Linux, or not allowed
        logger.debug("background compiles keep their priority: %r", exc)


class _Task:
    __slots__ = ("fn", "args", "future", "idle", "queued_at")

    def __init__(self, fn: Callable, args: tuple, idle: bool) -> None:
        self.fn, self.args, self.idle = fn, args, idle
        self.future: Future = Future()
        self.queued_at = time.monotonic()


class BackgroundCompiles:
    """A small pool of low-priority threads running compile tasks (see the module docstring).

    `submit(fn, *args, idle=...)` returns a `Future` that can be cancelled until its task
    starts. Tasks wait for `settle_seconds` of quiet when `hold_while_busy` (a CPU backend);
    paid ones start first, in order."""

    def __init__(
        self,
        max_workers: int = 1,
        *,
        hold_while_busy: bool = True,
        settle_seconds: float = 0.5,
        max_hold_seconds: Optional[float] = 30.0,
        activity: EngineActivity = ACTIVITY,
    ) -> None:
        self.max_workers = max(1, max_workers)
        self.hold_while_busy = hold_while_busy
        self.settle_seconds = settle_seconds
        self.max_hold_seconds = max_hold_seconds  # None: paid compiles too wait for quiet
        self._forced_at = -float("inf")  # when a paid compile last started while engines were busy
        self.started_busy = 0  # paid compiles started while engines were busy
        self._activity = activity
        self._lock = threading.Lock()
        self._paid: list[_Task] = []
        self._idle: list[_Task] = []
        self._threads: list[threading.Thread] = []
        self._running = 0
        self._closed = False
        self._low: Optional[ThreadPoolExecutor] = None  # the low-priority thread (`at_low_priority`)
        self.done = 0  # tasks finished (compiled, or failed)

    def at_low_priority(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the low-priority thread (one at a time), waited for: what a task does
        that takes the cores without holding the GIL (XLA's compile)."""
        with self._lock:
            if self._low is None:
                self._low = ThreadPoolExecutor(
                    1, thread_name_prefix="jaxllm-background-xla", initializer=lower_thread_priority
                )
            low = self._low
        return low.submit(fn, *args).result()

    @property
    def pending(self) -> int:
        """Tasks queued or running."""
        with self._lock:
            return len(self._paid) + len(self._idle) + self._running

    def submit(self, fn: Callable[..., Any], *args: Any, idle: bool = False) -> Future:
        task = _Task(fn, args, idle)
        with self._lock:
            if self._closed:
                task.future.set_exception(RuntimeError("background compiles are closed"))
                return task.future
            (self._idle if idle else self._paid).append(task)
            if len(self._threads) < self.max_workers:
                thread = threading.Thread(target=self._work, name="jaxllm-background-compile", daemon=True)
                self._threads.append(thread)
                thread.start()
        return task.future

    def close(self) -> None:
        """Drop queued tasks (their futures are cancelled); a task under way finishes."""
        with self._lock:
            self._closed = True
            queued, self._paid, self._idle = self._paid + self._idle, [], []
            threads = list(self._threads)
        for task in queued:
            task.future.cancel()
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join()
        if self._low is not None:
            self._low.shutdown(wait=True)

    def _next(self) -> Optional[_Task]:
        """The next task to run, waiting while an engine is busy (see `hold_while_busy`); None
        once closed or when nothing is queued."""
        while True:
            with self._lock:
                if self._closed:
                    return None
                self._paid = [t for t in self._paid if not t.future.cancelled()]
                self._idle = [t for t in self._idle if not t.future.cancelled()]
                if not self._paid and not self._idle:
                    return None
                quiet = self._activity.quiet_for() if self.hold_while_busy else self.settle_seconds
                if quiet >= self.settle_seconds:
                    return (self._paid or self._idle).pop(0)
                wait = max(0.05, self.settle_seconds - quiet)
                hold = self.max_hold_seconds
                if hold is not None and self._paid and not self._running:
                    now = time.monotonic()
                    due = max(self._paid[0].queued_at, self._forced_at) + hold
                    if now >= due:
                        self._forced_at = now
                        self.started_busy += 1
                        return self._paid.pop(0)
                    wait = min(wait, max(0.05, due - now))
            self._activity.wait(wait)

    def _work(self) -> None:
        while True:
            task = self._next()
            if task is None:
                with self._lock:
                    # Exit only when nothing new was queued meanwhile (else keep serving it).
                    if self._closed or not (self._paid or self._idle):
                        self._threads.remove(threading.current_thread())
                        return
                continue
            if not task.future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._running += 1
            try:
                result = task.fn(*task.args)
            except BaseException as exc:
                task.future.set_exception(exc)
            else:
                task.future.set_result(result)
            finally:
                with self._lock:
                    self._running -= 1
                    self.done += 1


def compile_counts(engine: Any) -> dict[str, int]:
    """An engine's background compiles: `pending` (queued, under way, or held for idle time:
    the buckets a background warm-up left and those steps asked for) and `done`."""
    programs = getattr(getattr(engine, "runner", None), "programs", None)
    if programs is None:  # an engine that compiles nothing in the background
        return {"pending": 0, "done": 0}
    pending = programs.background_pending
    for compiler in (getattr(engine, "bucket_compiler", None), getattr(engine, "decode_compiler", None)):
        if compiler is not None:
            pending += compiler.num_waiting
    return {"pending": pending, "done": programs.background_done}
