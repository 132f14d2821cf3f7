"""The output tokens of a steady decode batch, kept in one array until something reads them.

A steady decode step gives each of its n requests one token. Writing each token into its
request's `output_token_ids` (and, at commit, a placeholder before it) touches n request
objects per step. On a host whose caches the device work has just evicted, that costs about
1 µs per request: more than the rest of the step at a few hundred requests. A steady batch
instead records each step's tokens as one row of a numpy array (`DecodeTokenLog.record`) and
writes them into the requests' lists only when something needs them:

* every `capacity` steps (the array is full);
* for a few rows, when the KV cache indexes a request's full block for prefix reuse
  (`flush_rows`, called by `KVCacheManager.prepare_decode` for the rows it visits);
* for all rows, once (`materialize`), before any other code reads the requests: the general
  scheduler and batch building, a general read-back, a stop check that may end a request,
  finishing or aborting one.

While a log is live, a request's output is its list followed by its column of the log, and
steps committed but not yet read back have no placeholder in the list. `materialize`
restores the general invariant (the list holds every read-back token and one
`PLACEHOLDER_TOKEN` per committed step still in flight) and ends the log; the batch's later
steps use placeholders like any other step.
"""

from __future__ import annotations

import numpy as np

from jaxllm.llm_request import LlmRequest, LlmRequestState

PLACEHOLDER_TOKEN = -1
"""An output token sampled by a step still in flight (its value is on the device)."""

_COMPLETE = LlmRequestState.GENERATION_COMPLETE


class DecodeTokenLog:
    """Tokens read back for a steady batch's requests (row i of the batch: `requests[i]`)
    that are not yet in their `output_token_ids`."""

    __slots__ = ("requests", "tokens", "count", "flushed", "num_committed", "num_recorded", "live")

    def __init__(self, requests: list[LlmRequest], capacity: int = 64) -> None:
        if capacity < 1:
            raise ValueError(f"a token log needs a capacity of at least 1 step, got {capacity}")
        self.requests = requests
        self.tokens = np.empty((capacity, len(requests)), np.int32)  # step x row
        self.count = 0  # steps held in `tokens`
        self.flushed = np.zeros(len(requests), np.int64)  # per row: steps of `tokens` already in its list
        self.num_committed = 0  # steps committed to this log since it started
        self.num_recorded = 0  # of those, steps whose tokens were recorded
        self.live = True

    def commit(self) -> None:
        """A step of the batch was committed: its tokens will come to `record`."""
        self.num_committed += 1

    def record(self, row_tokens: np.ndarray) -> None:
        """The tokens of the oldest committed step not yet recorded, one per row."""
        if self.num_recorded >= self.num_committed:
            raise RuntimeError("a token log recorded more steps than were committed to it")
        if self.count == self.tokens.shape[0]:
            self._flush_all()
        self.tokens[self.count] = row_tokens
        self.count += 1
        self.num_recorded += 1

    def last_tokens(self):
        """Each row's newest recorded token (None when every recorded token is in the lists)."""
        return self.tokens[self.count - 1] if self.count else None

    def flush_rows(self, rows: list[int]) -> None:
        """Write the recorded tokens of `rows` into their requests' lists."""
        count = self.count
        if not count or not rows:
            return
        flushed, requests = self.flushed, self.requests
        columns = self.tokens[:count, rows].T.tolist()  # one gather for all the rows
        for i, column, start in zip(rows, columns, flushed[rows].tolist()):
            if start < count:
                requests[i].output_token_ids.extend(column[start:] if start else column)
        flushed[rows] = count

    def materialize(self) -> None:
        """Write every recorded token into the lists, add one placeholder per committed step
        still in flight, and end the log (a no-op on an ended log)."""
        if not self.live:
            return
        self.live = False
        self._flush_all()
        owed = self.num_committed - self.num_recorded
        if owed:
            placeholders = [PLACEHOLDER_TOKEN] * owed
            for request in self.requests:
                if request.state is not _COMPLETE:
                    request.output_token_ids.extend(placeholders)

    def _flush_all(self) -> None:
        count = self.count
        if count:
            columns = self.tokens[:count].T.tolist()
            for request, column, start in zip(self.requests, columns, self.flushed.tolist()):
                request.output_token_ids.extend(column[start:] if start else column)
        self.count = 0
        self.flushed[:] = 0
