"""What a batch `generate` call takes, in one shape: `LLM.generate` and
`GenerationExecutor.generate` accept one prompt or a list, and for each per-prompt setting
(sampling params, LoRA adapter, KV retention) one value for all prompts or a list of one per
prompt. Both normalise through `normalize_inputs`, so they accept and refuse the same things.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxllm.kv_cache.retention import KvCacheRetentionConfig, retention_configs_per_prompt
from jaxllm.lora.lora_request import LoRARequest
from jaxllm.sampling import SamplingParams

PromptInput = str | Sequence[int]


def is_single_prompt(inputs: Any) -> bool:
    """A str, a list of int token ids, or a 1-D numpy array of them (a 2-D array is a batch)."""
    if isinstance(inputs, np.ndarray):
        return inputs.ndim == 1
    return isinstance(inputs, str) or (
        isinstance(inputs, (list, tuple)) and len(inputs) > 0 and all(isinstance(t, int) for t in inputs)
    )


def per_prompt_loras(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    """One adapter (or None) for every prompt: one given for all, or a list of one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if isinstance(lora_request, (list, tuple)):
        if len(lora_request) != num_prompts:
            raise ValueError(f"lora_request has {len(lora_request)} entries for {num_prompts} prompts")
        return list(lora_request)
    raise ValueError(f"lora_request must be a jaxllm.LoRARequest or a list of them, got {type(lora_request).__name__}")


@dataclass(frozen=True)
class PromptBatch:
    """A batch call's prompts, each with its own settings (all lists of the same length)."""

    prompts: list[PromptInput]
    sampling_params: list[SamplingParams]
    lora_requests: list[LoRARequest | None]
    retention_configs: list[KvCacheRetentionConfig | None]
    single: bool  # the call passed one prompt, so it returns one output rather than a list


def normalize_inputs(
    inputs: Any, sampling_params: Any = None, lora_request: Any = None, kv_cache_retention_config: Any = None
) -> PromptBatch:
    """Broadcast a batch call's arguments to one entry per prompt (ValueError naming the argument)."""
    single = is_single_prompt(inputs)
    if not single and not isinstance(inputs, (list, tuple, np.ndarray)):
        raise ValueError(
            f"inputs must be a prompt (str or token ids) or a list of prompts, got {type(inputs).__name__}"
        )
    prompts = [inputs] if single else list(inputs)
    if not prompts:
        raise ValueError("inputs is empty: pass a prompt or a list of prompts")
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        params = [sampling_params] * len(prompts)
    else:
        params = list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
    loras = per_prompt_loras(lora_request, len(prompts))
    retention = retention_configs_per_prompt(kv_cache_retention_config, len(prompts))
    return PromptBatch(prompts, params, loras, retention, single)
