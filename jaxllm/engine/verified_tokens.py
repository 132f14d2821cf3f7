"""A verified speculative step on the host: what its read-back needs, and each row's tokens applied.

The row's accepted drafts plus the target's next token are written one token at a time through
the same stop checks as without speculation (end ids, stop token ids, max_tokens, min_tokens),
with their logprobs, and the KV sequence is rolled back to the tokens kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from jaxllm.engine.step_plan import TokenEntry
from jaxllm.engine.step_updates import RequestUpdate
from jaxllm.llm_request import LlmRequest
from jaxllm.outputs import Logprob
from jaxllm.sampling import check_stop
from jaxllm.sampling.rejection import VerifyOutput


@dataclass
class SpeculativeStep:
    """What a dispatched speculative step needs when its tokens are read back."""

    entries: list[TokenEntry]  # the speculating rows: (request, row, output index)
    drafts: list[list[int]]  # each row's drafts
    starts: list[int]  # each row's first verification entry
    output: VerifyOutput  # device arrays
    wants_logprobs: bool
    stats: dict = field(default_factory=dict)


def apply_verified(
    requests: Any,
    kv: Any,
    request: LlmRequest,
    index: int,
    tokens: list[int],
    start: int,
    logprobs: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]],
) -> RequestUpdate:
    """Write a row's tokens one at a time (over its placeholder, then appended), stopping
    at the first that ends the request; roll its KV back to what it keeps. `requests`: the
    engine's `RequestTable` (finishes requests that stop); `kv`: its KV cache manager."""
    outputs = request.output_token_ids
    params = request.sampling_params
    update = RequestUpdate(request, [])
    for j, token in enumerate(tokens):
        i = index + j
        if i < len(outputs):
            outputs[i] = token
        else:
            outputs.append(token)
        update.new_token_ids.append(token)
        if params.logprobs is not None and logprobs is not None:
            chosen, top_ids, top_lps = logprobs
            e = start + j
            entry = {
                int(top_ids[e, rank]): Logprob(float(top_lps[e, rank]), rank + 1) for rank in range(params.logprobs)
            }
            if token not in entry:
                entry[token] = Logprob(float(chosen[e]))
            update.new_logprobs.append(entry)
            request.cumulative_logprob += float(chosen[e])
        reason, stop_reason = check_stop(params, outputs, request.end_ids, num_outputs=i + 1)
        if reason is not None:
            requests.finish(request, reason, stop_reason, i + 1)
            update.finished = True
            return update
    kv.roll_back(request, request.num_tokens)
    return update
