"""Postprocess workers: detokenization and stop strings in separate processes.

With many streams, decoding text costs Python time per token and per stream; in worker
processes it neither holds the executor's GIL nor delays the engine thread. Each
sequence is pinned to one worker (rid % N), so its events stay in order. Workers run the
same `OutputProcessor` as the in-process path and import neither JAX nor the engine.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
from typing import Callable, Optional

from jaxllm.executor.output_processor import Delta, OutputProcessor, portable_error

logger = logging.getLogger(__name__)

_READY = "ready"
_DONE = "done"


def _worker_main(worker_id: int, tokenizer_dir: str, inbox, outbox) -> None:
    """Entry point of one worker process: events in, deltas out, until a None arrives."""
    try:
        from jaxllm.tokenizer import load_tokenizer

        processor = OutputProcessor(load_tokenizer(tokenizer_dir))
    except BaseException as exc:  # report why we could not start
        outbox.put((_READY, worker_id, portable_error(exc)))
        return
    outbox.put((_READY, worker_id, None))
    while True:
        events = inbox.get()
        if events is None:
            break
        outbox.put(processor.process(events))
    outbox.put((_DONE, worker_id, None))


class PostprocessWorkerPool:
    """N worker processes plus one collector thread that hands their deltas back."""

    def __init__(self, num_workers: int, tokenizer_dir: str, on_deltas: Callable[[list[Delta]], None],
                 on_fatal: Callable[[BaseException], None], *, start_timeout: float = 120.0) -> None:
        if num_workers < 1:
            raise ValueError(f"num_postprocess_workers must be >= 1 here, got {num_workers}")
        self.num_workers = num_workers
        self._on_deltas = on_deltas
        self._on_fatal = on_fatal
        ctx = mp.get_context("spawn")  # never fork a process that runs JAX threads
        self._inboxes = [ctx.Queue() for _ in range(num_workers)]
        self._outbox = ctx.Queue()
        self._procs = [ctx.Process(target=_worker_main, args=(i, str(tokenizer_dir), self._inboxes[i], self._outbox),
                                   name=f"jaxllm-postproc-{i}", daemon=True) for i in range(num_workers)]
        self._closing = False
        for proc in self._procs:
            proc.start()
        try:
            self._wait_ready(start_timeout)
        except BaseException:
            self._kill()
            raise
        self._collector = threading.Thread(target=self._collect, name="jaxllm-postproc-collector", daemon=True)
        self._collector.start()

    def _wait_ready(self, timeout: float) -> None:
        ready = 0
        while ready < self.num_workers:
            try:
                tag, worker_id, error = self._outbox.get(timeout=timeout)
            except queue.Empty:
                raise RuntimeError(f"postprocess workers did not start within {timeout}s") from None
            if error is not None:
                raise RuntimeError(f"postprocess worker {worker_id} failed to start: {error!r}")
            ready += 1

    def route(self, events: list[tuple]) -> None:
        """Send each event to the worker that owns its sequence (one message per worker)."""
        if self.num_workers == 1:
            self._inboxes[0].put(events)
            return
        per_worker: list[list[tuple]] = [[] for _ in range(self.num_workers)]
        for event in events:
            per_worker[event[1] % self.num_workers].append(event)
        for inbox, batch in zip(self._inboxes, per_worker):
            if batch:
                inbox.put(batch)

    def _collect(self) -> None:
        done = 0
        try:
            while done < self.num_workers:
                try:
                    item = self._outbox.get(timeout=0.5)
                except queue.Empty:
                    dead = [p for p in self._procs if not p.is_alive() and p.exitcode not in (0, None)]
                    if dead:
                        raise RuntimeError(f"postprocess worker {dead[0].name} died (exit code {dead[0].exitcode})")
                    if self._closing and not any(p.is_alive() for p in self._procs):
                        break
                    continue
                if isinstance(item, tuple):
                    done += item[0] == _DONE
                    continue
                if item:
                    self._on_deltas(item)
        except BaseException as exc:
            logger.exception("postprocess collector failed")
            self._on_fatal(exc)

    def close(self, timeout: float = 30.0) -> None:
        """Let the workers finish what they have, then stop them; waits for the collector."""
        if self._closing:
            return
        self._closing = True
        for inbox in self._inboxes:
            try:
                inbox.put(None)
            except (OSError, ValueError):
                pass
        self._collector.join(timeout)
        for proc in self._procs:
            proc.join(timeout)
        self._kill()

    def _kill(self) -> None:
        killed = False
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
                killed = True
        for q in [*self._inboxes, self._outbox]:
            q.close()
            if killed:
                q.cancel_join_thread()  # nobody will read what is still buffered
            else:
                q.join_thread()

    @property
    def pids(self) -> list[Optional[int]]:
        return [p.pid for p in self._procs]
