"""The engine's active requests, and the one place a request is finished or failed.

`RequestTable` holds every admitted, unfinished request. Besides the requests it keeps a few
counts (requests that read their token history, want logprobs, search beams, ask for logits),
so that a step knows whether any request needs something special without a pass over all of
them; the counts change only in `add` and `finish`, from one description of what a request
needs (`_needs`). Finishing frees a request's KV blocks and adapter slot; failing finishes it
with an error message. The read-back and beam search call these, never the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Optional

from jaxllm.engine.admission import AdmittedRequest
from jaxllm.engine.beam_search import BeamRun, BeamSearch
from jaxllm.engine.logits_outputs import LogitsRecord
from jaxllm.engine.step_updates import RequestUpdate
from jaxllm.engine.token_log import PLACEHOLDER_TOKEN
from jaxllm.llm_request import LlmRequest
from jaxllm.sampling import SamplingParams, resolve_seed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Needs:
    """What one request adds to the table's counts."""

    history: int
    logprobs: int
    beam_search: int
    logits: int


def new_request(
    request_id: int,
    admitted: AdmittedRequest,
    params: SamplingParams,
    *,
    arrival_time: float,
    sequence_index: int,
    lora_adapter: Any,
    retention: Any,
) -> LlmRequest:
    """The `LlmRequest` of an admitted prompt, with what its sampling settings ask for: its
    seed, a beam search, a record of its logits."""
    request = LlmRequest(
        request_id=request_id,
        prompt_token_ids=admitted.prompt_token_ids,
        max_new_tokens=params.max_tokens,
        priority=admitted.priority,
        arrival_time=arrival_time,
        sampling_params=params,
    )
    request.seed = resolve_seed(params, sequence_index)
    request.end_ids = admitted.end_ids
    request.lora_adapter = lora_adapter
    request.kv_cache_retention_config = retention
    if params.use_beam_search:
        if request_id < 0:
            raise ValueError(f"request_id must be >= 0 for beam search, got {request_id}")
        request.beam_width = params.beam_width
        end_ids = frozenset(() if params.ignore_eos else admitted.end_ids)
        request.beam = BeamRun(
            BeamSearch(
                params.beam_width, params.max_tokens, end_ids, float(params.length_penalty), params.early_stopping
            ),
            [request],
            params.n,
        )
    if (
        params.wants_context_logits
        or params.return_generation_logits
        or params.logits_processor is not None
        or params.logits_post_processor_name is not None
    ):
        request.logits_record = LogitsRecord(
            list(admitted.prompt_token_ids),
            keep_context=params.return_context_logits,
            prompt_k=params.prompt_logprobs,
        )
        request.reuse_prefix = not params.wants_context_logits  # cached blocks have no logits
    return request


def _needs(request: LlmRequest) -> _Needs:
    params = request.sampling_params
    return _Needs(
        int(params.needs_history),
        int(params.logprobs is not None),
        int(request.beam is not None),
        int(request.logits_record is not None),
    )


class RequestTable:
    """Active requests by id, their counts, and finishing / failing them."""

    def __init__(
        self, *, planner: Any, kv_cache_manager: Any, lora_slots: Any = None, guided_matchers: Any = None
    ) -> None:
        """`planner`: its `materialize_tokens` writes logged tokens into the requests before a
        request's outputs are cut; `kv_cache_manager` / `lora_slots` / `guided_matchers` free
        what a request held."""
        self._planner = planner
        self._kv = kv_cache_manager
        self._lora_slots = lora_slots
        self._guided_matchers = guided_matchers
        # Called with (request, reason) before a finished request's blocks are freed (the
        # disaggregated hand-over holds a context-only request's blocks there).
        self.before_free: Optional[Callable[[LlmRequest, str], None]] = None
        self._active: dict[int, LlmRequest] = {}
        self.num_needing_history = 0  # sampling reads every previous token (penalties, bad words)
        self.num_wanting_logprobs = 0
        self.num_beam_search = 0  # each runs every other overlapped step
        self.num_logits_requests = 0  # logits outputs or post-processors (jaxllm.engine.logits_outputs)
        # Counts admissions and finishes: while it is unchanged, the set of active requests is.
        self.changes = 0

    def __len__(self) -> int:
        return len(self._active)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._active

    def __iter__(self) -> Iterator[LlmRequest]:
        return iter(self._active.values())

    def get(self, request_id: int) -> Optional[LlmRequest]:
        return self._active.get(request_id)

    def view(self) -> Mapping[int, LlmRequest]:
        """The active requests by id, read-only."""
        return MappingProxyType(self._active)

    @property
    def needs_host_tokens(self) -> bool:
        """Whether some request needs each step's tokens on the host at once (so a steady batch
        may not keep them in a log): logits outputs, logprobs, penalties, beams."""
        return bool(
            self.num_logits_requests or self.num_wanting_logprobs or self.num_needing_history or self.num_beam_search
        )

    def _count(self, request: LlmRequest, sign: int) -> None:
        needs = _needs(request)
        self.num_needing_history += sign * needs.history
        self.num_wanting_logprobs += sign * needs.logprobs
        self.num_beam_search += sign * needs.beam_search
        self.num_logits_requests += sign * needs.logits
        self.changes += 1

    def add(self, request: LlmRequest) -> None:
        if request.request_id in self._active:
            raise ValueError(f"request_id {request.request_id} is already in use by an unfinished request")
        self._active[request.request_id] = request
        self._count(request, +1)

    def context_logits_pending(self) -> bool:
        """Whether an active request asks for its prompt's logits and has prompt left to run."""
        if not self.num_logits_requests:
            return False
        return any(r.sampling_params.wants_context_logits and r.is_context_phase for r in self._active.values())

    @staticmethod
    def num_resolved(request: LlmRequest) -> int:
        """Output tokens already read back (the rest are placeholders of a step in flight)."""
        resolved = len(request.output_token_ids)
        while resolved and request.output_token_ids[resolved - 1] == PLACEHOLDER_TOKEN:
            resolved -= 1
        return resolved

    def finish(self, request: LlmRequest, reason: str, stop_reason: Any, num_outputs: int) -> None:
        """End `request` with `reason`, keeping its first `num_outputs` tokens; frees its KV
        blocks and adapter slot."""
        self._planner.materialize_tokens()
        del request.output_token_ids[num_outputs:]
        request.stop_reason = stop_reason
        request.finish(reason)
        if self.before_free is not None:
            self.before_free(request, reason)
        self._kv.free_resources(request)
        if self._lora_slots is not None:
            self._lora_slots.release(request)
        if self._guided_matchers is not None:
            self._guided_matchers.release(request)
        if self._active.pop(request.request_id, None) is not None:
            self._count(request, -1)

    def fail(self, requests: list[LlmRequest], exc: BaseException, where: str) -> list[RequestUpdate]:
        """Finish requests with 'error' (their blocks are freed) and report why."""
        logger.error("step %s failed for request(s) %s: %r", where, [r.request_id for r in requests], exc)
        message = f"the engine failed this request while {where}: {type(exc).__name__}: {exc}"
        self._planner.materialize_tokens()
        updates = []
        for request in requests:
            if request.is_finished:
                continue
            self.finish(request, "error", None, self.num_resolved(request))
            updates.append(RequestUpdate(request, [], finished=True, error=message))
        return updates

    def abort(self, request_id: int) -> Optional[LlmRequest]:
        """Finish a request as 'cancelled' and free its blocks at once (None: no such request)."""
        request = self._active.get(request_id)
        if request is None:
            return None
        self._planner.materialize_tokens()
        self.finish(request, "cancelled", None, self.num_resolved(request))
        return request
