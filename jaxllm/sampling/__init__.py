"""Sampling parameters, their per-step device tensors, the jittable sampler and stop checks."""

from jaxllm.sampling.params import (
    GREEDY_TEMPERATURE_EPS,
    MAX_LOGPROBS,
    SamplingParams,
    resolve_end_ids,
    resolve_seed,
)
from jaxllm.sampling.sampler import SamplerOutput, apply_penalties, apply_suppression, sample
from jaxllm.sampling.stopping import check_stop
from jaxllm.sampling.tensors import SUPPRESS_WIDTH, SamplingTensors

__all__ = [
    "GREEDY_TEMPERATURE_EPS",
    "MAX_LOGPROBS",
    "SUPPRESS_WIDTH",
    "SamplerOutput",
    "SamplingParams",
    "SamplingTensors",
    "apply_penalties",
    "apply_suppression",
    "check_stop",
    "resolve_end_ids",
    "resolve_seed",
    "sample",
]
