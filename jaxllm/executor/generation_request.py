"""What a caller submits to the executor (TensorRT-LLM's `GenerationRequest`)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from jaxllm.kv_cache.retention import KvCacheRetentionConfig, check_retention_config
from jaxllm.llm_args import DisaggregatedParams
from jaxllm.lora.lora_request import LoRARequest
from jaxllm.sampling import SamplingParams
from jaxllm.sampling.params import _show


def _is_finite_number(v) -> bool:
    if not isinstance(v, (int, float, np.integer, np.floating)) or isinstance(v, (bool, np.bool_)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def _is_token_id(t) -> bool:
    return isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_))


@dataclass
class GenerationRequest:
    """One prompt (as token ids) and how to sample it.

    `id` is assigned by `GenerationExecutor.submit`. `timeout` (seconds after arrival)
    finishes the request with 'timeout' when it runs out, keeping what was generated.
    `prompt` is the original text, kept only so outputs can echo it back.
    """

    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    streaming: bool = False
    prompt: Optional[str] = None
    priority: float = 0.0
    timeout: Optional[float] = None
    arrival_time: float = field(default_factory=time.monotonic)
    id: Optional[int] = None
    lora_request: Optional[LoRARequest] = None  # the LoRA adapter to run with (None: the base model)
    kv_cache_retention_config: Optional[KvCacheRetentionConfig] = None
    # Disaggregated serving: a context-only or generation-only request (TensorRT-LLM's field).
    disaggregated_params: Optional[DisaggregatedParams] = None

    def __post_init__(self) -> None:
        if isinstance(self.prompt_token_ids, (str, bytes)) or not hasattr(self.prompt_token_ids, "__len__"):
            raise ValueError("prompt_token_ids must be a list of int token ids")
        if isinstance(self.prompt_token_ids, np.ndarray):
            if self.prompt_token_ids.ndim != 1 or not np.issubdtype(self.prompt_token_ids.dtype, np.integer):
                raise ValueError(
                    "prompt_token_ids: a numpy array of token ids must be 1-D with an integer dtype, "
                    f"got shape {self.prompt_token_ids.shape} and dtype {self.prompt_token_ids.dtype}"
                )
            self.prompt_token_ids = self.prompt_token_ids.tolist()
        ids = list(self.prompt_token_ids)
        if not all(_is_token_id(t) for t in ids):
            bad = next(t for t in ids if not _is_token_id(t))
            raise ValueError(f"prompt_token_ids must hold int token ids, got {_show(bad)}")
        self.prompt_token_ids = [int(t) for t in ids]
        if not isinstance(self.sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(self.sampling_params).__name__}")
        if not _is_finite_number(self.priority):
            raise ValueError(f"priority must be a finite number, got {_show(self.priority)}")
        if not isinstance(self.streaming, bool):
            raise ValueError(f"streaming must be a bool, got {self.streaming!r}")
        if self.lora_request is not None and not isinstance(self.lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a jaxllm.LoRARequest, got {type(self.lora_request).__name__}")
        if self.timeout is not None and not (_is_finite_number(self.timeout) and self.timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {_show(self.timeout)}")
        check_retention_config(self.kv_cache_retention_config)
        disagg = self.disaggregated_params
        if disagg is not None:
            if not isinstance(disagg, DisaggregatedParams):
                raise ValueError(
                    f"disaggregated_params must be a jaxllm.DisaggregatedParams, got {type(disagg).__name__}"
                )
            if disagg.request_type != "context_and_generation" and self.num_sequences != 1:
                raise ValueError("disaggregated_params: n and best_of must be 1 for a disaggregated request")

    @property
    def num_sequences(self) -> int:
        """How many engine requests this prompt fans out into (best_of, else n)."""
        params = self.sampling_params
        if params.use_beam_search:  # one engine request whose beams give the n outputs
            return params.n
        return max(params.n, params.best_of or 1)
