"""What a caller submits to the executor (TensorRT-LLM's `GenerationRequest`)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

from jaxllm.sampling import SamplingParams


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

    def __post_init__(self) -> None:
        if isinstance(self.prompt_token_ids, (str, bytes)) or not hasattr(self.prompt_token_ids, "__len__"):
            raise ValueError("prompt_token_ids must be a list of int token ids")
        ids = list(self.prompt_token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            bad = next(t for t in ids if not isinstance(t, int) or isinstance(t, bool))
            raise ValueError(f"prompt_token_ids must hold int token ids, got {bad!r}")
        self.prompt_token_ids = ids
        if not isinstance(self.sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(self.sampling_params).__name__}")
        if not isinstance(self.streaming, bool):
            raise ValueError(f"streaming must be a bool, got {self.streaming!r}")
        if self.timeout is not None and not (isinstance(self.timeout, (int, float)) and
                                             not isinstance(self.timeout, bool) and
                                             math.isfinite(self.timeout) and self.timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {self.timeout!r}")

    @property
    def num_sequences(self) -> int:
        """How many engine requests this prompt fans out into (best_of, else n)."""
        params = self.sampling_params
        return max(params.n, params.best_of or 1)
