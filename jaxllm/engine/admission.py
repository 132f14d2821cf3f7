"""Admission: the one place where a request is checked before the engine accepts it.

Everything the step relies on (token ids inside the vocabulary and int32, at most
`SUPPRESS_WIDTH` ids banned per step, lengths within `max_seq_len` and the KV cache, a
numeric priority, strict types) is checked here, once, with a ValueError naming the
field, so a request that passes can never fail a step; the engine's step-level fault
isolation is only a backstop. The limits are fixed when the engine is built, so any thread
may check: a request enters through the executor, which calls `validate_request` (through
`LLMEngine.validate_request`) at submission and hands the `AdmittedRequest` to the engine
thread, whose `add_request` trusts it. Called without one (the engine used directly),
`add_request` checks the request itself. What only the engine thread can know (a request
id already in use) is checked there, in `add_request`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import numpy as np

from jaxllm.sampling import SUPPRESS_WIDTH, SamplingParams, is_finite_number, resolve_end_ids
from jaxllm.sampling.params import is_integer

MAX_PROMPT_LOGPROBS_LEN = 4096
"""Longest prompt a `prompt_logprobs` request may have: its answer is a Python dict of up to
21 entries per prompt token, built on the engine thread and sent as JSON."""


@dataclass(frozen=True)
class AdmissionLimits:
    """The engine's limits a request is checked against (fixed when the engine is built)."""

    vocab_size: int
    max_seq_len: int
    default_end_ids: tuple[int, ...]  # the model's end ids, banned until min_tokens
    tokens_per_block: int
    max_blocks_per_request: int  # min(block-table row, whole KV pool)
    max_num_tokens: int
    enable_chunked_prefill: bool = True
    suppress_width: int = SUPPRESS_WIDTH
    # Names of the device-side batched logits post-processors registered on the engine.
    batched_processor_names: tuple[str, ...] = ()
    # Why this engine cannot return logits or run post-processors (None: it can).
    logits_unsupported: Optional[str] = None

    @classmethod
    def of_engine(
        cls, config: Any, vocab_size: int, max_seq_len: int, eos_ids: Any, kv: Any, capabilities: Any
    ) -> AdmissionLimits:
        """The limits of an engine built from `config` (`kv`: its KV cache manager)."""
        return cls(
            vocab_size=vocab_size,
            max_seq_len=max_seq_len,
            default_end_ids=tuple(sorted(eos_ids)),
            tokens_per_block=kv.tokens_per_block,
            max_blocks_per_request=min(kv.max_blocks_per_seq, kv.get_max_resource_count()),
            max_num_tokens=config.max_num_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            batched_processor_names=tuple(sorted(config.logits_post_processors or ())),
            logits_unsupported=capabilities.logits_outputs,
        )


class AdmittedRequest(NamedTuple):
    """The normalised request: plain-int prompt ids, a float priority, resolved end ids."""

    prompt_token_ids: list[int]
    priority: float
    end_ids: list[int]


def normalize_prompt(prompt_token_ids: Any, vocab_size: int) -> list[int]:
    """Prompt ids as a list of Python ints (from a list, tuple or 1-D integer numpy array)."""
    if isinstance(prompt_token_ids, np.ndarray):
        if prompt_token_ids.ndim != 1 or prompt_token_ids.dtype.kind not in "iu":
            raise ValueError(
                "prompt_token_ids: a numpy array of token ids must be 1-D with an integer "
                f"dtype, got dtype {prompt_token_ids.dtype} and shape {prompt_token_ids.shape}"
            )
        ids = prompt_token_ids.tolist()
    elif isinstance(prompt_token_ids, (list, tuple)):
        ids = list(prompt_token_ids)
        if not all(type(t) is int for t in ids):
            for t in ids:
                if not is_integer(t):
                    raise ValueError(f"prompt_token_ids: token ids must be integers, got {type(t).__name__}")
            ids = [int(t) for t in ids]
    else:
        raise ValueError(f"prompt_token_ids must be a list of integer token ids, got {type(prompt_token_ids).__name__}")
    if not ids:
        raise ValueError("prompt_token_ids: the prompt is empty; a request needs at least one prompt token")
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"prompt_token_ids: token id {bad} is outside the vocabulary [0, {vocab_size})")
    return ids


def _check_ids_in_vocab(name: str, ids: Sequence[int], vocab_size: int) -> None:
    for t in ids:
        if t >= vocab_size:
            raise ValueError(f"{name}: token id {t} is outside the vocabulary [0, {vocab_size})")


def _banned_at_once(params: SamplingParams, end_ids: Sequence[int]) -> tuple[int, int]:
    """(ids banned at every step, ids banned in a step before min_tokens): the most that
    `SamplingTensors.build` may have to write into one row's `suppress_ids`."""
    always = {seq[-1] for seq in params.bad_word_ids if seq}
    early = set(always)
    if params.min_tokens > 0:
        if not params.ignore_eos:
            early.update(end_ids)
        early.update(params.stop_token_ids or ())
    return len(always), len(early)


def _check_logits_request(params: SamplingParams, limits: AdmissionLimits) -> None:
    """Logits outputs and post-processors the engine can serve (see jaxllm.engine.logits_outputs)."""
    name = params.logits_post_processor_name
    asked = [
        field
        for field, on in (
            ("return_context_logits", params.return_context_logits),
            ("return_generation_logits", params.return_generation_logits),
            ("prompt_logprobs", params.prompt_logprobs is not None),
            ("logits_processor", params.logits_processor is not None),
            ("logits_post_processor_name", name is not None),
        )
        if on
    ]
    if asked and limits.logits_unsupported is not None:
        raise ValueError(f"{asked[0]}: {limits.logits_unsupported}")
    if asked and params.use_beam_search:
        raise ValueError(f"{asked[0]}: logits outputs and post-processors are not supported with beam search")
    if name is not None and name not in limits.batched_processor_names:
        known = ", ".join(limits.batched_processor_names) or "none are registered"
        raise ValueError(
            f"logits_post_processor_name: no batched logits post-processor named {name!r} is "
            f"registered on the engine (EngineConfig.logits_post_processors: {known})"
        )


def validate_request(
    prompt_token_ids: Any, params: Any, limits: AdmissionLimits, *, priority: Any = 0.0, tokenizer: Any = None
) -> AdmittedRequest:
    """Check one request against the engine's limits; ValueError naming the field, else the
    normalised request. `tokenizer` tokenizes `params.bad` (needed to count banned ids)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    params.validate()
    if not is_finite_number(priority):
        shown = repr(priority)[:40] if isinstance(priority, (str, bool, float)) else type(priority).__name__
        raise ValueError(f"priority must be a finite number, got {shown}")
    prompt = normalize_prompt(prompt_token_ids, limits.vocab_size)
    _check_logits_request(params, limits)
    if params.prompt_logprobs is not None and len(prompt) > MAX_PROMPT_LOGPROBS_LEN:
        raise ValueError(
            f"prompt_logprobs: the prompt ({len(prompt)} tokens) is longer than the "
            f"{MAX_PROMPT_LOGPROBS_LEN} tokens prompt_logprobs is served for"
        )
    vocab = limits.vocab_size
    for name in ("end_id", "pad_id"):
        value = getattr(params, name)
        if value is not None and value != -1:
            _check_ids_in_vocab(name, [value], vocab)
    _check_ids_in_vocab("stop_token_ids", params.stop_token_ids or (), vocab)
    _check_ids_in_vocab("bad_token_ids", params.bad_token_ids or (), vocab)
    if params.bad and params._bad_word_ids is None:
        if tokenizer is None:
            raise ValueError("bad: bad strings need a tokenizer")
        params.setup(tokenizer)
    _check_ids_in_vocab("bad", [t for seq in params.bad_word_ids for t in seq], vocab)

    end_ids = resolve_end_ids(params, limits.default_end_ids)
    always, early = _banned_at_once(params, end_ids)
    width = limits.suppress_width
    if always > width:
        raise ValueError(
            f"bad_token_ids: bad_token_ids and bad words ban {always} distinct token ids, "
            f"more than the {width} supported per request"
        )
    if early > width:
        field = "stop_token_ids" if params.stop_token_ids else "min_tokens"
        raise ValueError(
            f"{field}: until min_tokens ({params.min_tokens}) outputs exist, the end ids, stop_token_ids "
            f"and bad words ban {early} distinct token ids, more than the {width} supported per request"
        )

    total = len(prompt) + params.max_tokens
    if total > limits.max_seq_len:
        raise ValueError(
            f"max_tokens: prompt length {len(prompt)} + max_tokens {params.max_tokens} "
            f"exceeds max_seq_len {limits.max_seq_len}"
        )
    blocks = -(-total // limits.tokens_per_block)
    if blocks > limits.max_blocks_per_request:
        raise ValueError(
            f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) needs {blocks} "
            f"KV blocks but a sequence can hold at most {limits.max_blocks_per_request}"
        )
    if not limits.enable_chunked_prefill and len(prompt) > limits.max_num_tokens:
        raise ValueError(
            f"prompt_token_ids: the prompt ({len(prompt)} tokens) exceeds max_num_tokens "
            f"({limits.max_num_tokens}) and chunked prefill is off"
        )
    return AdmittedRequest(prompt, float(priority), end_ids)


def check_sequence_index(sequence_index: Any) -> int:
    if not is_integer(sequence_index) or sequence_index < 0:
        raise ValueError(f"sequence_index must be an integer >= 0, got {sequence_index!r}")
    return int(sequence_index)


def check_arrival_time(arrival_time: Optional[Any]) -> Optional[float]:
    if arrival_time is None:
        return None
    if not is_finite_number(arrival_time):
        raise ValueError(f"arrival_time must be a finite number, got {type(arrival_time).__name__}")
    return float(arrival_time)
