"""Result objects returned to users (field names follow TensorRT-LLM / vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union


@dataclass
class Logprob:
    logprob: float
    rank: Optional[int] = None


TokenLogprobs = list[dict[int, Logprob]]
# vLLM's prompt_logprobs: None for the first prompt token, then one dict per prompt token.
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass
class SpeculativeDecodingMetrics:
    """A speculating sequence's drafts (TensorRT-LLM's `SpeculativeDecodingMetrics` fields):
    draft tokens it verified, how many were accepted, and their ratio."""

    total_draft_tokens: int = 0
    total_accepted_draft_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.total_accepted_draft_tokens / self.total_draft_tokens if self.total_draft_tokens else 0.0


@dataclass
class CompletionOutput:
    """One generated sequence. The `*_diff` views hold what arrived since the last update."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[TokenLogprobs] = None
    finish_reason: Optional[str] = None  # 'stop' | 'length' | 'timeout' | 'cancelled'
    stop_reason: Optional[Union[int, str]] = None
    text_diff: str = ""
    token_ids_diff: list[int] = field(default_factory=list)
    logprobs_diff: Optional[TokenLogprobs] = None
    # float32 numpy [num_generated, vocab]: the raw logits each token was sampled from
    # (return_generation_logits; set on the final output).
    generation_logits: Optional[Any] = None
    prompt_logprobs: Optional[PromptLogprobs] = None  # SamplingParams.prompt_logprobs
    # Draft tokens verified and accepted (set on the final output when the sequence drafted).
    speculative_decoding: Optional[SpeculativeDecodingMetrics] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: int
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    context_logits: Optional[Any] = None  # float32 numpy [prompt_len, vocab] (return_context_logits)
    prompt_logprobs: Optional[PromptLogprobs] = None  # as vLLM's RequestOutput.prompt_logprobs
