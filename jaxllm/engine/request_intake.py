"""Admitting a request: the checks, then the `LlmRequest` the engine runs.

`validate` is what the executor calls when a request is submitted, from any thread: it raises
ValueError naming the field and changes nothing. `create` turns an admitted prompt into a
request (its id, LoRA adapter, KV retention and arrival time); the engine then adds it to its
request table, or hands a generation-only request to the KV transceiver first.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from jaxllm.engine.admission import (
    AdmissionLimits,
    AdmittedRequest,
    check_arrival_time,
    check_sequence_index,
    validate_request,
)
from jaxllm.engine.capabilities import Capabilities
from jaxllm.engine.guided_matchers import GuidedMatchers
from jaxllm.engine.lora_adapters import EngineAdapters
from jaxllm.engine.requests import RequestTable, new_request
from jaxllm.kv_cache.retention import check_retention_config
from jaxllm.llm_request import LlmRequest
from jaxllm.sampling import SamplingParams


@dataclass
class RequestIntake:
    """An engine's admission: its limits and the parts a request is checked against."""

    limits: AdmissionLimits
    tokenizer: Any
    guided: GuidedMatchers
    capabilities: Capabilities
    kv_cache_manager: Any  # KVCacheManager, or RankedKvCaches under attention DP
    adapters: EngineAdapters
    requests: RequestTable
    attention_dp: bool
    ids: itertools.count = field(default_factory=itertools.count)

    def next_request_id(self) -> int:
        return next(self.ids)

    def validate(
        self, prompt_token_ids: Any, params: Any, *, priority: Any = 0.0, lora_request: Any = None
    ) -> AdmittedRequest:
        """Admission checks (ValueError naming the field)."""
        admitted = validate_request(prompt_token_ids, params, self.limits, priority=priority, tokenizer=self.tokenizer)
        self.adapters.resolve(lora_request)
        if params.guided_decoding is not None:
            self.guided.check_request(params, admitted.end_ids, attention_dp=self.attention_dp)
        if params.use_beam_search:  # validate_request checked it is SamplingParams
            kv = self.kv_cache_manager
            self.capabilities.check_beam_search(
                params, len(admitted.prompt_token_ids), kv.tokens_per_block, kv.get_max_resource_count()
            )
        return admitted

    def create(
        self,
        prompt_token_ids: Any,
        params: SamplingParams,
        *,
        request_id: Optional[int],
        priority: float,
        arrival_time: Optional[float],
        sequence_index: int,
        lora_request: Any,
        kv_cache_retention_config: Any,
        admitted: Optional[AdmittedRequest],
    ) -> LlmRequest:
        """A new request (ValueError naming the field if it breaks a limit); `admitted`: the
        result of `validate` when the caller ran it already (the executor does, at submission)."""
        if admitted is None:
            admitted = self.validate(prompt_token_ids, params, priority=priority)
        retention = check_retention_config(kv_cache_retention_config)
        adapter = self.adapters.resolve(lora_request)
        sequence_index = check_sequence_index(sequence_index)
        arrival_time = check_arrival_time(arrival_time)
        if request_id is None:
            request_id = self.next_request_id()
        elif not isinstance(request_id, int) or isinstance(request_id, bool):
            raise ValueError(f"request_id must be an int, got {type(request_id).__name__}")
        elif request_id in self.requests:
            raise ValueError(f"request_id {request_id} is already in use by an unfinished request")
        return new_request(
            request_id,
            admitted,
            params,
            sequence_index=sequence_index,
            lora_adapter=adapter,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            retention=retention,
        )
