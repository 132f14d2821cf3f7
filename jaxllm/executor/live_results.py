"""The executor's table of live results: which `GenerationResult` (and which of its sequences)
each engine request id feeds, and the step deltas routed to them.

The output thread applies deltas while request threads register and cancel results, so one lock
guards the table; results are pushed and woken outside it."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

from jaxllm.executor.output_processor import Delta
from jaxllm.executor.result import GenerationResult, wake


@dataclass
class AppliedDeltas:
    """What the executor must tell the engine after `LiveResults.apply`: requests whose output
    failed (their results are forgotten; the caller aborts and fails them), and engine request
    ids that hit a stop string or id (aborted with 'stop')."""

    failed: list[tuple[GenerationResult, BaseException]] = field(default_factory=list)
    stops: list[int] = field(default_factory=list)


class LiveResults:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._results: dict[int, GenerationResult] = {}
        self._children: dict[int, tuple[GenerationResult, int]] = {}  # engine rid -> (result, sequence index)

    def __len__(self) -> int:
        return len(self._results)

    def get(self, request_id: int) -> Optional[GenerationResult]:
        return self._results.get(request_id)

    def add(self, results: Iterable[GenerationResult]) -> None:
        """Register results whose engine request ids are attached."""
        with self._lock:
            for result in results:
                self._results[result.request_id] = result
                for index, rid in enumerate(result.engine_request_ids):
                    self._children[rid] = (result, index)

    def forget(self, results: Iterable[GenerationResult]) -> None:
        with self._lock:
            for result in results:
                self._forget_locked(result)

    def apply(self, deltas: list[Delta]) -> AppliedDeltas:
        """Push a step's deltas into their results (grouped per result, then woken together);
        a finished sequence leaves the table, and its result once every sequence finished."""
        grouped: dict[GenerationResult, list[tuple[int, Delta]]] = {}
        applied = AppliedDeltas()
        with self._lock:
            for delta in deltas:
                entry = self._children.get(delta.rid)
                if entry is None:
                    continue
                result, index = entry
                if delta.error is not None:
                    applied.failed.append((result, delta.error))
                    self._forget_locked(result)
                    continue
                if delta.stop_hit:
                    applied.stops.append(delta.rid)
                if delta.finish_reason is not None:
                    del self._children[delta.rid]
                    if result.child_finished():
                        self._results.pop(result.request_id, None)
                grouped.setdefault(result, []).append((index, delta))
        wakeups: dict = {}
        for result, items in grouped.items():
            result.push(items, wakeups)
        wake(wakeups)
        return applied

    def fail_all(self, error: BaseException) -> None:
        """Fail every live result (the engine stopped: nothing will reach them)."""
        with self._lock:
            results = list(self._results.values())
            self._results.clear()
            self._children.clear()
        for result in results:
            result.fail(error)

    def _forget_locked(self, result: GenerationResult) -> None:
        self._results.pop(result.request_id, None)
        for rid in result.engine_request_ids:
            self._children.pop(rid, None)
