"""Postprocess workers: detokenization and stop strings in separate processes.

With many streams, decoding text costs Python time per token and per stream; in worker
processes it neither holds the executor's GIL nor delays the engine thread. Each
sequence is pinned to one worker (rid % N, or the next live one), so its events stay in
order. Workers run the same `OutputProcessor` as the in-process path and import neither
JAX nor the engine.

Each worker talks to the executor over two pipes of its own (no queue shared between
workers, hence no lock or semaphore a killed worker could leave held). If a worker dies,
its sequences fail with an error and the others go on; when none is left the pool
reports a fatal error.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Optional

from jaxllm.executor.output_processor import ADD, DECODED, ERROR, TOKENS, Delta, OutputProcessor, portable_error

logger = logging.getLogger(__name__)

_READY = "ready"
_DONE = "done"


def _worker_main(worker_id: int, tokenizer_dir: str, inbox: Connection, outbox: Connection) -> None:
    """Entry point of one worker process: events in, deltas out, until a None (or EOF) arrives."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the executor decides when workers stop
    try:
        from jaxllm.tokenizer import load_tokenizer

        processor = OutputProcessor(load_tokenizer(tokenizer_dir))
    except BaseException as exc:  # report why we could not start
        outbox.send((_READY, worker_id, portable_error(exc)))
        return
    outbox.send((_READY, worker_id, None))
    while True:
        try:
            events = inbox.recv()
        except EOFError:
            break
        if events is None:
            break
        outbox.send(processor.process(events))
    outbox.send((_DONE, worker_id, None))


class _Worker:
    def __init__(self, index: int, proc, to_worker: Connection, from_worker: Connection) -> None:
        self.index = index
        self.proc = proc
        self.pid: Optional[int] = proc.pid
        self.to_worker = to_worker
        self.from_worker = from_worker
        self.alive = True
        self.done = False  # it answered the stop message


class PostprocessWorkerPool:
    """N worker processes plus one collector thread that hands their deltas back."""

    def __init__(
        self,
        num_workers: int,
        tokenizer_dir: str,
        on_deltas: Callable[[list[Delta]], None],
        on_fatal: Callable[[BaseException], None],
        *,
        start_timeout: float = 120.0,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_postprocess_workers must be >= 1 here, got {num_workers}")
        self.num_workers = num_workers
        self._on_deltas = on_deltas
        self._on_fatal = on_fatal
        self._lock = threading.Lock()  # guards _owner and the workers' alive flags
        self._owner: dict[int, int] = {}  # rid -> worker index
        self._closing = False
        ctx = mp.get_context("spawn")  # never fork a process that runs JAX threads
        self._workers: list[_Worker] = []
        try:
            for i in range(num_workers):
                inbox_r, inbox_w = ctx.Pipe(duplex=False)
                outbox_r, outbox_w = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_worker_main,
                    args=(i, str(tokenizer_dir), inbox_r, outbox_w),
                    name=f"jaxllm-postproc-{i}",
                    daemon=True,
                )
                proc.start()
                inbox_r.close()  # the child's ends: closing ours lets EOF / EPIPE reach both sides
                outbox_w.close()
                self._workers.append(_Worker(i, proc, inbox_w, outbox_r))
            self._wait_ready(start_timeout)
        except BaseException:
            self._kill()
            raise
        self._collector = threading.Thread(target=self._collect, name="jaxllm-postproc-collector", daemon=True)
        self._collector.start()

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for worker in self._workers:
            if not worker.from_worker.poll(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"postprocess workers did not start within {timeout}s")
            try:
                _, worker_id, error = worker.from_worker.recv()
            except EOFError:
                raise RuntimeError(
                    f"postprocess worker {worker.index} exited while starting (exit code {worker.proc.exitcode})"
                ) from None
            if error is not None:
                raise RuntimeError(f"postprocess worker {worker_id} failed to start: {error!r}")

    # ------------------------------------------------------------------ routing (output thread)
    def _pick_locked(self, rid: int) -> Optional[int]:
        for k in range(self.num_workers):
            index = (rid + k) % self.num_workers
            if self._workers[index].alive:
                return index
        return None

    def route(self, events: list[tuple]) -> None:
        """Send each event to the worker that owns its sequence (one message per worker)."""
        batches: dict[int, list[tuple]] = {}
        orphans: list[int] = []
        with self._lock:
            for event in events:
                kind, rid = event[0], event[1]
                if kind == DECODED:  # split by owner: each worker gets its rows as one event
                    parts: dict[int, tuple[list, list]] = {}
                    owner = self._owner
                    for rid, token in zip(event[1], event[2]):
                        index = owner.get(rid)
                        if index is not None:
                            part = parts.get(index)
                            if part is None:
                                part = parts[index] = ([], [])
                            part[0].append(rid)
                            part[1].append(token)
                    for index, (rids, tokens) in parts.items():
                        batches.setdefault(index, []).append((DECODED, rids, tokens))
                    continue
                if kind == ADD:
                    index = self._pick_locked(rid)
                    if index is None:
                        orphans.append(rid)
                        continue
                    self._owner[rid] = index
                else:
                    index = self._owner.get(rid)
                    if index is None:  # its worker died and the sequence was already failed
                        continue
                    if kind == ERROR or (kind == TOKENS and event[4] is not None):
                        del self._owner[rid]  # the sequence's last event
                batches.setdefault(index, []).append(event)
        for index, batch in batches.items():
            worker = self._workers[index]
            if not worker.alive:
                continue
            try:
                worker.to_worker.send(batch)
            except (OSError, ValueError):  # broken pipe: the worker is gone
                self._worker_lost(worker)
        if orphans:
            self._on_deltas([Delta(rid, error=RuntimeError("no postprocess worker is alive")) for rid in orphans])

    # ------------------------------------------------------------------ collecting (collector thread)
    def _collect(self) -> None:
        try:
            while True:
                readers = {w.from_worker: w for w in self._workers if w.alive}
                if not readers:
                    break
                for conn in wait(list(readers), timeout=0.5):
                    worker = readers[conn]
                    try:
                        item = conn.recv()
                    except (EOFError, OSError):
                        self._worker_lost(worker)
                        continue
                    if isinstance(item, tuple):
                        if item[0] == _DONE:
                            worker.done = True
                            self._worker_lost(worker)
                        continue
                    if item:
                        self._on_deltas(item)
        except BaseException as exc:
            logger.exception("postprocess collector failed")
            self._on_fatal(exc)

    def _worker_lost(self, worker: _Worker) -> None:
        """A worker stopped (asked to, or died): fail its sequences; fatal when none is left."""
        with self._lock:
            if not worker.alive:
                return
            worker.alive = False
            orphans = [rid for rid, index in self._owner.items() if index == worker.index]
            for rid in orphans:
                del self._owner[rid]
            any_alive = any(w.alive for w in self._workers)
        try:
            worker.from_worker.close()
        except OSError:
            pass
        if worker.done or self._closing:
            return
        worker.proc.join(5)
        error = RuntimeError(f"postprocess worker {worker.proc.name} died (exit code {worker.proc.exitcode})")
        logger.error("%s; failing its %d sequence(s)", error, len(orphans))
        if orphans:
            self._on_deltas([Delta(rid, error=error) for rid in orphans])
        if not any_alive:
            self._on_fatal(RuntimeError(f"every postprocess worker died; the last: {error}"))

    # ------------------------------------------------------------------ shutdown
    def close(self, timeout: float = 30.0) -> None:
        """Let the workers finish what they have, then stop them; waits for the collector."""
        if self._closing:
            return
        self._closing = True
        for worker in self._workers:
            if worker.alive:
                try:
                    worker.to_worker.send(None)
                except (OSError, ValueError):
                    pass
        self._collector.join(timeout)
        for worker in self._workers:
            worker.proc.join(timeout)
        self._kill()

    def _kill(self) -> None:
        for worker in self._workers:
            if worker.proc.is_alive():
                worker.proc.terminate()
                worker.proc.join(5)
            for conn in (worker.to_worker, worker.from_worker):
                try:
                    conn.close()
                except OSError:
                    pass
            try:
                worker.proc.close()
            except ValueError:  # still running (terminate failed): leave it to the OS
                pass

    @property
    def pids(self) -> list[Optional[int]]:
        return [w.pid for w in self._workers]
