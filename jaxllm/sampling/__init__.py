"""Sampling parameters, their per-step device tensors, the jittable sampler and stop checks."""

from jaxllm.sampling.guided import GuidedDecodingParams
from jaxllm.sampling.params import (
    GREEDY_TEMPERATURE_EPS,
    INT32_MAX,
    MAX_LOGPROBS,
    MAX_SEQUENCES,
    SamplingParams,
    is_finite_number,
    resolve_end_ids,
    resolve_seed,
    sequence_seed,
)
from jaxllm.sampling.sampler import SamplerOutput, apply_penalties, apply_suppression, sample
from jaxllm.sampling.stopping import check_stop
from jaxllm.sampling.tensors import GENERAL_VARIANT, SAMPLER_VARIANTS, SUPPRESS_WIDTH, SamplingTensors

__all__ = [
    "GENERAL_VARIANT",
    "GREEDY_TEMPERATURE_EPS",
    "GuidedDecodingParams",
    "INT32_MAX",
    "MAX_LOGPROBS",
    "MAX_SEQUENCES",
    "SAMPLER_VARIANTS",
    "SUPPRESS_WIDTH",
    "SamplerOutput",
    "SamplingParams",
    "SamplingTensors",
    "apply_penalties",
    "apply_suppression",
    "check_stop",
    "is_finite_number",
    "resolve_end_ids",
    "resolve_seed",
    "sequence_seed",
    "sample",
]
