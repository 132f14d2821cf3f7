"""KV cache retention: how long a request's cached prefix blocks should survive eviction.

Mirrors TensorRT-LLM's `KvCacheRetentionConfig`. A request names token ranges of its prompt
(`TokenRangeRetentionConfig`) and a priority for the blocks it generates (decode blocks);
each priority is 0..100 (default 35). Among cached blocks nobody uses, the reuse cache
evicts the lowest priority first and, within a priority, the least recently released. A
`duration_ms` limits how long a block keeps its priority once it is released: after that
it falls back to the default priority.

A prompt block takes the priority of the range that holds its *first* token (as the
reference computes it per block); blocks no range covers keep the default. Blocks past the
prompt take `decode_retention_priority` / `decode_duration_ms`.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

MIN_RETENTION_PRIORITY = 0
MAX_RETENTION_PRIORITY = 100
DEFAULT_RETENTION_PRIORITY = 35

Duration = None | int | float | datetime.timedelta


def _check_priority(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"{name} must be an int in [{MIN_RETENTION_PRIORITY}, {MAX_RETENTION_PRIORITY}], got {value!r}"
        )
    if not MIN_RETENTION_PRIORITY <= value <= MAX_RETENTION_PRIORITY:
        raise ValueError(f"{name} must be in [{MIN_RETENTION_PRIORITY}, {MAX_RETENTION_PRIORITY}], got {value}")
    return value


def _duration_seconds(name: str, value: Duration) -> float | None:
    """Milliseconds (int/float) or a `datetime.timedelta` -> seconds; None stays None."""
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value) / 1000.0
    else:
        raise ValueError(f"{name} must be milliseconds (a number), a datetime.timedelta or None, got {value!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{name} must be a positive duration, got {value!r}")
    return seconds


@dataclass(frozen=True)
class TokenRangeRetentionConfig:
    """Priority for the prompt tokens [token_start, token_end) (`token_end=None`: to the end
    of the prompt); `duration_ms` (milliseconds or a timedelta) after release, the blocks fall
    back to the default priority (None: they keep it until evicted)."""

    token_start: int
    token_end: int | None = None
    priority: int = DEFAULT_RETENTION_PRIORITY
    duration_ms: Duration = None

    def __post_init__(self) -> None:
        if isinstance(self.token_start, bool) or not isinstance(self.token_start, int) or self.token_start < 0:
            raise ValueError(f"token_start must be a non-negative int, got {self.token_start!r}")
        if self.token_end is not None:
            if isinstance(self.token_end, bool) or not isinstance(self.token_end, int):
                raise ValueError(f"token_end must be an int or None, got {self.token_end!r}")
            if self.token_end <= self.token_start:
                raise ValueError(
                    f"token range [{self.token_start}, {self.token_end}) is empty: "
                    "token_end must be greater than token_start"
                )
        _check_priority("priority", self.priority)
        object.__setattr__(self, "_seconds", _duration_seconds("duration_ms", self.duration_ms))

    @property
    def duration_seconds(self) -> float | None:
        return self._seconds  # type: ignore[attr-defined]  # set by __post_init__ (a frozen dataclass)


@dataclass(frozen=True)
class KvCacheRetentionConfig:
    """Per-request retention priorities for the KV blocks of its prompt ranges and of its
    generated tokens (TensorRT-LLM's `KvCacheRetentionConfig`).

    `max_tokens=N` is a shorthand for one range `[0, N)` at the highest priority (keep the
    first N tokens cached); it cannot be combined with explicit ranges.
    """

    token_range_retention_priorities: Sequence[TokenRangeRetentionConfig] = ()
    decode_retention_priority: int = DEFAULT_RETENTION_PRIORITY
    decode_duration_ms: Duration = None
    max_tokens: int | None = field(default=None, repr=False)

    TokenRangeRetentionConfig = TokenRangeRetentionConfig  # the reference's nested name
    kMinRetentionPriority = MIN_RETENTION_PRIORITY
    kMaxRetentionPriority = MAX_RETENTION_PRIORITY
    kDefaultRetentionPriority = DEFAULT_RETENTION_PRIORITY

    def __post_init__(self) -> None:
        ranges = self.token_range_retention_priorities
        if ranges is None:
            ranges = ()
        if isinstance(ranges, TokenRangeRetentionConfig) or not isinstance(ranges, (list, tuple)):
            raise ValueError(
                "token_range_retention_priorities must be a list of TokenRangeRetentionConfig, "
                f"got {type(ranges).__name__}"
            )
        for r in ranges:
            if not isinstance(r, TokenRangeRetentionConfig):
                raise ValueError(
                    "token_range_retention_priorities must hold TokenRangeRetentionConfig "
                    f"entries, got {type(r).__name__}"
                )
        if self.max_tokens is not None:
            if ranges:
                raise ValueError(
                    "max_tokens is a shorthand for one token range; pass either max_tokens or "
                    "token_range_retention_priorities, not both"
                )
            if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
                raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
            ranges = (TokenRangeRetentionConfig(0, self.max_tokens, MAX_RETENTION_PRIORITY),)
        ranges = tuple(sorted(ranges, key=lambda r: r.token_start))
        for i, r in enumerate(ranges[:-1]):
            if r.token_end is None:
                raise ValueError(
                    f"only the last token range may have token_end=None (open-ended); "
                    f"[{r.token_start}, None) is followed by a range at {ranges[i + 1].token_start}"
                )
            if r.token_end > ranges[i + 1].token_start:
                raise ValueError(
                    f"token ranges must not overlap: [{r.token_start}, {r.token_end}) and "
                    f"[{ranges[i + 1].token_start}, {ranges[i + 1].token_end})"
                )
        object.__setattr__(self, "token_range_retention_priorities", ranges)
        _check_priority("decode_retention_priority", self.decode_retention_priority)
        object.__setattr__(self, "_decode_seconds", _duration_seconds("decode_duration_ms", self.decode_duration_ms))

    @property
    def decode_duration_seconds(self) -> float | None:
        return self._decode_seconds  # type: ignore[attr-defined]  # set by __post_init__ (a frozen dataclass)

    def prompt_block_retention(self, block_index: int, tokens_per_block: int) -> tuple[int | None, float | None]:
        """(priority, duration in seconds) of prompt block `block_index`, from the range holding
        its first token; (None, None) when no range covers it (the block keeps what it has)."""
        first = block_index * tokens_per_block
        for r in self.token_range_retention_priorities:
            if r.token_start > first:
                break
            if r.token_end is None or first < r.token_end:
                return r.priority, r.duration_seconds
        return None, None

    def per_block_priorities(self, tokens_per_block: int, seq_len: int) -> list[int | None]:
        """Priority of each block of a `seq_len`-token prompt (None: not covered)."""
        return [self.prompt_block_retention(i, tokens_per_block)[0] for i in range(-(-seq_len // tokens_per_block))]

    def block_retention(
        self, block_index: int, tokens_per_block: int, prompt_len: int
    ) -> tuple[int | None, float | None]:
        """(priority, seconds) for block `block_index` of a sequence whose prompt has
        `prompt_len` tokens: a prompt block by its range, a generated block by the decode
        settings. Priority None means "not set by this request"."""
        if block_index * tokens_per_block < prompt_len:
            return self.prompt_block_retention(block_index, tokens_per_block)
        return self.decode_retention_priority, self.decode_duration_seconds


def check_retention_config(value: Any) -> KvCacheRetentionConfig | None:
    """Admission check of the `kv_cache_retention_config` argument (None is allowed)."""
    if value is None or isinstance(value, KvCacheRetentionConfig):
        return value
    raise ValueError(f"kv_cache_retention_config must be a KvCacheRetentionConfig or None, got {type(value).__name__}")


def retention_configs_per_prompt(value: Any, num_prompts: int) -> list[KvCacheRetentionConfig | None]:
    """`kv_cache_retention_config` of a batch call: one config (or None) for every prompt, or a
    list with one entry per prompt."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_prompts:
            raise ValueError(f"kv_cache_retention_config has {len(value)} entries for {num_prompts} prompts")
        return [check_retention_config(v) for v in value]
    return [check_retention_config(value)] * num_prompts
