"""Speculative decoding configs (TensorRT-LLM's LLM API classes and field names).

`LLM(..., speculative_config=NGramDecodingConfig(...))`, the YAML key `speculative_config`
(a mapping with `decoding_type: NGram | MTP | DraftTarget | Eagle`) and the CLI's
`--speculative-config` JSON in vLLM's shape (`{"method": "ngram", "num_speculative_tokens": k}`)
all end up as one of these dataclasses (`parse_speculative_config`). Each checks its own fields
and raises a ValueError naming the bad one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

MAX_DRAFT_LEN_LIMIT = 16
"""The most draft tokens one step may verify per request (bounds the verification shapes)."""


def _check_int(owner: str, name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{owner}.{name} must be an integer in [{low}, {high}], got {value!r}")
    return value


def _check_bool(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{name} must be true or false, got {value!r}")
    return value


@dataclass
class NGramDecodingConfig:
    """Drafts looked up in the request's own prompt and output (prompt lookup decoding):
    the last n tokens (n from `max_matching_ngram_size` down to 1) are matched against earlier
    text and the `max_draft_len` tokens that followed are proposed. `is_public_pool`: one pool
    of n-grams shared by all requests; `is_keep_all`: keep every continuation seen for an
    n-gram (else the latest); `is_use_oldest`: propose the oldest continuation kept."""

    max_draft_len: int = 4
    max_matching_ngram_size: int = 3
    is_keep_all: bool = True
    is_use_oldest: bool = True
    is_public_pool: bool = False
    decoding_type = "NGram"

    def __post_init__(self) -> None:
        _check_int("NGramDecodingConfig", "max_draft_len", self.max_draft_len, 1, MAX_DRAFT_LEN_LIMIT)
        _check_int("NGramDecodingConfig", "max_matching_ngram_size", self.max_matching_ngram_size, 1, 64)
        for name in ("is_keep_all", "is_use_oldest", "is_public_pool"):
            _check_bool("NGramDecodingConfig", name, getattr(self, name))


@dataclass
class MTPDecodingConfig:
    """DeepSeek-V3/R1 multi-token prediction layers drafting `num_nextn_predict_layers` tokens.
    `use_relaxed_acceptance_for_thinking`: inside a `<think>`...`</think>` span a greedy row
    also accepts a draft among the target's `relaxed_topk` most probable tokens whose
    probability is at least the top token's minus `relaxed_delta` (TensorRT-LLM's rule)."""

    num_nextn_predict_layers: int = 1
    use_relaxed_acceptance_for_thinking: bool = False
    relaxed_topk: int = 1
    relaxed_delta: float = 0.0
    decoding_type = "MTP"

    def __post_init__(self) -> None:
        _check_int("MTPDecodingConfig", "num_nextn_predict_layers", self.num_nextn_predict_layers, 1, 16)
        _check_bool(
            "MTPDecodingConfig", "use_relaxed_acceptance_for_thinking", self.use_relaxed_acceptance_for_thinking
        )
        _check_int("MTPDecodingConfig", "relaxed_topk", self.relaxed_topk, 1, 1 << 10)
        if isinstance(self.relaxed_delta, bool) or not isinstance(self.relaxed_delta, (int, float)):
            raise ValueError(f"MTPDecodingConfig.relaxed_delta must be a number, got {self.relaxed_delta!r}")
        if self.relaxed_delta < 0:
            raise ValueError(f"MTPDecodingConfig.relaxed_delta must be >= 0, got {self.relaxed_delta}")

    @property
    def max_draft_len(self) -> int:
        return self.num_nextn_predict_layers


@dataclass
class DraftTargetDecodingConfig:
    """A smaller model with the same tokenizer drafting `max_draft_len` tokens per step."""

    max_draft_len: int = 4
    speculative_model_dir: Optional[str] = None
    decoding_type = "DraftTarget"

    def __post_init__(self) -> None:
        _check_int("DraftTargetDecodingConfig", "max_draft_len", self.max_draft_len, 1, MAX_DRAFT_LEN_LIMIT)
        if not self.speculative_model_dir or not isinstance(self.speculative_model_dir, str):
            raise ValueError("DraftTargetDecodingConfig.speculative_model_dir must name the draft model")


@dataclass
class EagleDecodingConfig:
    """EAGLE-3 draft heads (`speculative_model_dir`) drafting a chain of `max_draft_len` tokens."""

    max_draft_len: int = 4
    speculative_model_dir: Optional[str] = None
    eagle3_one_model: bool = True
    decoding_type = "Eagle"

    def __post_init__(self) -> None:
        _check_int("EagleDecodingConfig", "max_draft_len", self.max_draft_len, 1, MAX_DRAFT_LEN_LIMIT)
        if not self.speculative_model_dir or not isinstance(self.speculative_model_dir, str):
            raise ValueError("EagleDecodingConfig.speculative_model_dir must name the EAGLE-3 heads")
        _check_bool("EagleDecodingConfig", "eagle3_one_model", self.eagle3_one_model)


SpeculativeConfig = Union[NGramDecodingConfig, MTPDecodingConfig, DraftTargetDecodingConfig, EagleDecodingConfig]

DECODING_TYPES: dict[str, type] = {
    "NGram": NGramDecodingConfig,
    "MTP": MTPDecodingConfig,
    "DraftTarget": DraftTargetDecodingConfig,
    "Eagle": EagleDecodingConfig,
}

# vLLM's `method` names -> (config class, {vLLM key: our field}).
VLLM_METHODS: dict[str, tuple[type, dict[str, str]]] = {
    "ngram": (
        NGramDecodingConfig,
        {"num_speculative_tokens": "max_draft_len", "prompt_lookup_max": "max_matching_ngram_size"},
    ),
    "mtp": (
        MTPDecodingConfig,
        {
            "num_speculative_tokens": "num_nextn_predict_layers",
            # TensorRT-LLM's names (vLLM has no relaxed acceptance).
            "use_relaxed_acceptance_for_thinking": "use_relaxed_acceptance_for_thinking",
            "relaxed_topk": "relaxed_topk",
            "relaxed_delta": "relaxed_delta",
        },
    ),
    "draft_model": (
        DraftTargetDecodingConfig,
        {"num_speculative_tokens": "max_draft_len", "model": "speculative_model_dir"},
    ),
    "eagle3": (EagleDecodingConfig, {"num_speculative_tokens": "max_draft_len", "model": "speculative_model_dir"}),
}


def _build(cls: type, values: dict[str, Any], where: str) -> SpeculativeConfig:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"{where}: unknown field(s) {', '.join(unknown)} for {cls.__name__}; known: {', '.join(sorted(known))}"
        )
    return cls(**values)


def parse_speculative_config(value: Any) -> Optional[SpeculativeConfig]:
    """A config object from what a caller gave: a config object, a mapping (TensorRT-LLM's
    YAML shape with `decoding_type`, or vLLM's with `method`), a JSON string of either, or None."""
    if value is None or isinstance(value, tuple(DECODING_TYPES.values())):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a mapping or a config object, got {type(value).__name__}")
    values = dict(value)
    if "decoding_type" in values:
        kind = values.pop("decoding_type")
        cls = DECODING_TYPES.get(kind)
        if cls is None:
            raise ValueError(
                f"speculative_config.decoding_type must be one of {', '.join(DECODING_TYPES)}, got {kind!r}"
            )
        return _build(cls, values, "speculative_config")
    if "method" in values:
        method = values.pop("method")
        entry = VLLM_METHODS.get(method)
        if entry is None:
            raise ValueError(f"speculative_config.method must be one of {', '.join(VLLM_METHODS)}, got {method!r}")
        cls, names = entry
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(unknown)} for method {method!r}; "
                f"known: {', '.join(sorted(names))}"
            )
        return _build(cls, {names[k]: v for k, v in values.items()}, "speculative_config")
    raise ValueError("speculative_config needs 'decoding_type' (NGram, MTP, DraftTarget, Eagle) or 'method'")
