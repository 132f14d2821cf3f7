"""Reading a dispatched step back: its sampled tokens into the requests, stops, updates.

`TokenReadback.process` waits for a step's tokens, writes them over the placeholders the
planner committed, checks stops (length, end ids, stop token ids) and reports what changed
(`jaxllm.engine.step_updates`). A steady decode step writes every token in one pass and
checks only the rows whose token may end their request; its other rows are reported
batched. Beam-search rows go to `jaxllm.engine.beam_search.advance_beams`. Finishing and
failing a request are the request table's (`finish` / `fail`: they free KV blocks and
adapter slots: `jaxllm.engine.requests.RequestTable`), so this reads back into that table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Optional

import jax
import numpy as np

from jaxllm.engine.beam_search import advance_beams
from jaxllm.engine.device_reads import all_to_host, blocking_read, to_host
from jaxllm.engine.logits_outputs import store_step_logits
from jaxllm.engine.planner import DecodeEntries
from jaxllm.engine.step_updates import DecodeTokens, RequestUpdate, StepUpdates
from jaxllm.kv_cache.manager import DecodeRows
from jaxllm.llm_request import LlmRequest, LlmRequestState
from jaxllm.outputs import Logprob
from jaxllm.sampling import check_stop

if TYPE_CHECKING:  # pragma: no cover
    from jaxllm.engine.requests import RequestTable
    from jaxllm.engine.step_output import PendingStep

_COMPLETE = LlmRequestState.GENERATION_COMPLETE
_output_token_ids = attrgetter("output_token_ids")


@dataclass
class BatchStops:
    """How the rows of one steady decode batch can end, built once per batch so that a step
    where no row can end costs a few numpy operations (`quiet`)."""

    decode: DecodeRows
    max_tokens: np.ndarray  # int64[n]
    end_ids: np.ndarray  # int64[n, w] per row, padded with -1 (which no token equals)
    always_check: np.ndarray  # bool[n] rows with stop token ids: every token is checked
    any_always_check: bool
    # The end ids of every row when all rows share them (() when none ends on an id), else None.
    common_end_ids: Optional[tuple[int, ...]]
    # Rows advance together (one token per step), so some row reaches max_tokens exactly when
    # the first row's output index reaches this value.
    length_due_at: int
    request_ids: list[int]  # of the rows, in order

    @classmethod
    def build(cls, decode: DecodeRows, index: np.ndarray) -> BatchStops:
        """`index`: each row's output index in one step of the batch."""
        requests = decode.requests
        n = len(requests)
        params = [r.sampling_params for r in requests]
        # ignore_eos: end ids end nothing.
        ends = [() if p.ignore_eos else tuple(r.end_ids) for r, p in zip(requests, params)]
        width = max(map(len, ends), default=0)
        end_ids = np.full((n, max(width, 1)), -1, np.int64)
        for i, row in enumerate(ends):
            end_ids[i, : len(row)] = row
        max_tokens = np.fromiter((p.max_tokens for p in params), np.int64, n)
        common = ends[0] if n and all(row == ends[0] for row in ends) else None
        margin = int((max_tokens - index - 1).min()) if n else 0
        always_check = np.fromiter((bool(p.stop_token_ids) for p in params), np.bool_, n)
        return cls(
            decode,
            max_tokens,
            end_ids,
            always_check,
            bool(always_check.any()),
            common,
            (int(index[0]) if n else 0) + margin,
            [r.request_id for r in requests],
        )

    def length_due(self, index: np.ndarray) -> bool:
        """Whether some row gets its last token (by max_tokens) at output `index`."""
        return bool(index.shape[0]) and int(index[0]) >= self.length_due_at

    def quiet(self, index: np.ndarray, row_tokens: np.ndarray) -> bool:
        """True if no row can end on `row_tokens` (so none needs a check)."""
        common = self.common_end_ids
        return (
            common is not None
            and not self.any_always_check
            and not self.length_due(index)
            and not any(end in row_tokens for end in common)
        )

    def rows_to_check(self, index: np.ndarray, row_tokens: np.ndarray) -> np.ndarray:
        """bool[n]: rows whose token may end their request."""
        return self.always_check | (index + 1 >= self.max_tokens) | (row_tokens[:, None] == self.end_ids).any(axis=1)


class TokenReadback:
    """Reads the engine's dispatched steps back (one at a time, on the engine's thread)."""

    def __init__(
        self,
        *,
        requests: RequestTable,
        kv_cache_manager: Any,
        planner: Any,
        copy_blocks: Callable[[list[tuple[int, int]]], None],
        expert_statistics: Any = None,
        load_balancer: Any = None,
    ) -> None:
        """`requests`: where requests are finished and failed; `copy_blocks`: the runner's KV
        block copy (beam forks); `expert_statistics` / `load_balancer`: where a step's expert
        counts go."""
        self.requests = requests
        self.kv_cache_manager = kv_cache_manager
        self.planner = planner
        self.copy_blocks = copy_blocks
        self.expert_statistics = expert_statistics
        self.load_balancer = load_balancer
        # Built once per steady decode batch.
        self._decode_stops: Optional[BatchStops] = None

    def process(self, pending: PendingStep) -> StepUpdates:
        """The updates of a dispatched step, once its tokens are on the host (waits for them).
        A plain step is one blocking read (`jaxllm.engine.device_reads`): its tokens, with its
        logprobs and expert counts when it has them; logits outputs and host processors'
        rows are one more each."""
        requests = self.requests
        out = pending.sampler_output
        logprobs = None
        if pending.wants_logprobs or pending.expert_counts is not None:
            host = all_to_host(
                out.token_ids,
                pending.expert_counts,
                *((out.logprobs, out.top_ids, out.top_logprobs) if pending.wants_logprobs else ()),
            )
            tokens, expert_counts = host[0], host[1]
            if pending.wants_logprobs:
                logprobs = host[2:]
        else:
            tokens, expert_counts = to_host(out.token_ids), None
        failed_processors = []
        processed = None
        if pending.processed_output is not None:
            try:
                with blocking_read():  # the processors' thread samples the rewritten rows; their copy
                    processed = jax.device_get(pending.processed_output.result())
            except Exception as exc:  # the processors' pass itself failed: its requests only
                failed_processors += requests.fail(list(pending.processor_requests), exc, "running logits processors")
            else:
                tokens = tokens.copy()
                rows = list(pending.processor_rows)
                tokens[rows] = np.asarray(processed.token_ids)[rows]
        for request, exc in pending.processor_failures or ():  # the user's callable failed: that request only
            failed_processors += requests.fail([request], exc, "running its logits_processor")
        writer = self.expert_statistics
        if expert_counts is not None:
            counts = expert_counts
            if self.load_balancer is not None:  # per slot: the placement changes while recording
                counts = self.load_balancer.observe(counts, pending.slot_tables)
            if writer is not None and writer.wants(pending.iteration):
                writer.record(pending.iteration, counts)
        if writer is not None and not writer.saved and pending.iteration + 1 >= writer.iter_stop:
            writer.save()
        if pending.logits_targets is not None:
            store_step_logits(pending.logits_targets, pending.context_logits, pending.row_logits, pending.entries)
        if logprobs is not None:
            if processed is not None:  # the processor rows' logprobs are those of their own pass
                rows = list(pending.processor_rows)
                logprobs = tuple(np.array(a) for a in logprobs)
                for mine, theirs in zip(logprobs, (processed.logprobs, processed.top_ids, processed.top_logprobs)):
                    mine[rows] = np.asarray(theirs)[rows]
        decode = pending.decode
        if (
            logprobs is None
            and decode is not None
            and not failed_processors
            and self.kv_cache_manager.decode_rows_current(decode)
        ):
            # No request of the step finished since it was dispatched (that frees KV blocks).
            return self.apply_decode_tokens(decode, pending.entries, tokens)
        if isinstance(pending.entries, DecodeEntries) and pending.entries.log is not None:
            self.planner.materialize_tokens()  # the loop below writes over the step's placeholders
        token_list = tokens.tolist()  # plain ints, converted once for the whole batch
        updates = failed_processors
        append = updates.append
        for request, row, index in pending.entries:
            out = request.output_token_ids
            if request.state is _COMPLETE or index >= len(out):
                continue
            params = request.sampling_params
            token = token_list[row]
            n = index + 1
            # The common case inline: no logprobs, and the token neither ends the request by
            # length nor can stop it (check_stop decides every other case).
            if (
                logprobs is None
                and n < params.max_tokens
                and token not in request.end_ids
                and not params.stop_token_ids
            ):
                out[index] = token
                append(RequestUpdate(request, [token]))
                continue
            try:
                append(self.apply_token(request, index, token, row, logprobs))
            except Exception as exc:  # host bookkeeping of one request: fail it alone
                updates += requests.fail([request], exc, "applying a sampled token")
        if pending.beam_entries:
            updates += advance_beams(requests, self.kv_cache_manager, self.copy_blocks, pending)
        return StepUpdates(updates)

    def apply_decode_tokens(self, decode: DecodeRows, entries: DecodeEntries, tokens: np.ndarray) -> StepUpdates:
        """`process` of a steady decode step without logprobs: the tokens go to the batch's
        token log (or over the placeholders, once the log has ended) in one pass, and only
        rows whose token may end the request (length, an end or stop token) are checked one
        by one; the other rows are reported batched (`DecodeTokens`)."""
        requests = decode.requests
        n = len(requests)
        index = entries.index
        stops = self.stops_of(decode, index)
        row_tokens = tokens[:n]
        token_list = row_tokens.tolist()
        log = entries.log
        if log is not None and log.live:
            log.record(row_tokens)
        else:
            for out, i, token in zip(map(_output_token_ids, requests), index.tolist(), token_list):
                out[i] = token  # a plain loop: half the cost of map(list.__setitem__, ...)
        if stops.quiet(index, row_tokens):
            return StepUpdates([], [DecodeTokens(requests, token_list, stops.request_ids)])
        checked = stops.rows_to_check(index, row_tokens)
        check = np.flatnonzero(checked).tolist()
        if not check:
            return StepUpdates([], [DecodeTokens(requests, token_list, stops.request_ids)])
        if log is not None:
            log.materialize()  # the checked rows read, and may end, their requests' outputs
        index_list = index.tolist()
        updates: list[RequestUpdate] = []
        for i in check:
            request = requests[i]
            try:
                updates.append(self.apply_token(request, index_list[i], token_list[i], i, None))
            except Exception as exc:  # host bookkeeping of one request: fail it alone
                updates += self.requests.fail([request], exc, "applying a sampled token")
        plain = np.flatnonzero(~checked).tolist()
        return StepUpdates(
            updates,
            [
                DecodeTokens(
                    list(map(requests.__getitem__, plain)),
                    list(map(token_list.__getitem__, plain)),
                    list(map(stops.request_ids.__getitem__, plain)),
                )
            ],
        )

    def stops_of(self, decode: DecodeRows, index: np.ndarray) -> BatchStops:
        """The stops of a steady decode batch, built once per batch (`index`: the output index
        of each row in one of its steps)."""
        stops = self._decode_stops
        if stops is None or stops.decode is not decode:
            stops = self._decode_stops = BatchStops.build(decode, index)
        return stops

    def apply_token(
        self,
        request: LlmRequest,
        index: int,
        token: int,
        row: int,
        logprobs: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]],
    ) -> RequestUpdate:
        """Write one token (and its logprobs) and finish the request if it stops there."""
        request.output_token_ids[index] = token
        update = RequestUpdate(request, [token])
        params = request.sampling_params
        if params.logprobs is not None:
            chosen_lp, top_ids, top_lps = logprobs
            # The `logprobs` most likely tokens with their ranks, then the chosen one (unranked)
            # when it is not among them.
            entry = {
                int(top_ids[row, rank]): Logprob(float(top_lps[row, rank]), rank + 1) for rank in range(params.logprobs)
            }
            if token not in entry:
                entry[token] = Logprob(float(chosen_lp[row]))
            update.new_logprobs.append(entry)
            request.cumulative_logprob += float(chosen_lp[row])
        reason, stop_reason = check_stop(params, request.output_token_ids, request.end_ids, num_outputs=index + 1)
        if reason is not None:
            self.requests.finish(request, reason, stop_reason, index + 1)
            update.finished = True
        return update
