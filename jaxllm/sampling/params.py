"""User-facing sampling parameters (field names and defaults follow TensorRT-LLM's
`SamplingParams`; validation follows vLLM's rules)."""

from __future__ import annotations

import hashlib
import math
import numbers
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any, NamedTuple, Optional, Union

import numpy as np

from jaxllm.sampling.guided import GuidedDecodingParams

MAX_LOGPROBS = 20
"""Largest top-N logprob count a request may ask for (the sampler always computes this many)."""

GREEDY_TEMPERATURE_EPS = 1e-5
"""Temperatures below this are treated as greedy, as in vLLM, to avoid dividing by ~0."""

_MAX_SEED = 2**64

INT32_MAX = 2**31 - 1
"""Token ids, token counts and top_k travel to the device as int32: larger values are refused."""

MAX_SEQUENCES = 128
"""Largest `n` / `best_of` (OpenAI's limit for `n`): each sequence is a request of its own."""

MAX_BEAM_WIDTH = 8
"""Largest beam width (`best_of`, else `n`, with `use_beam_search`), as in TensorRT-LLM."""

MAX_LENGTH_PENALTY = 10.0
"""Largest |length_penalty|: a beam's score divides by `length ** length_penalty`, which
overflows a float (or rounds every score to 0) far beyond the useful range of about +-3."""

EARLY_STOPPING_VALUES = (True, False, "never")


class _Row(NamedTuple):
    """The step-invariant sampler settings of one request, cached so that building the
    per-step tensors copies a tuple instead of re-deriving them."""

    # (temperature, top_k, top_p, min_p, repetition, presence, frequency) in the order of
    # the SamplingTensors columns; temperature 0 means greedy.
    values: tuple[float, float, float, float, float, float, float]
    greedy: bool
    has_penalties: bool
    has_bad_words: bool  # bans tokens at every step
    needs_history: bool  # penalties, bad words, a host logits processor or a grammar read the token history
    min_tokens: int  # bans end/stop ids while fewer outputs exist


# Equal `values` tuples are shared, so a batch of equal settings is detected by identity.
_INTERNED_VALUES: dict[tuple, tuple] = {}


def _show(v: Any, limit: int = 60) -> str:
    """A short repr for error messages (a hostile value may be huge)."""
    try:
        text = repr(v)
    except Exception:  # e.g. an int with more digits than Python will print
        text = f"<{type(v).__name__}>"
    return text if len(text) <= limit else text[:limit] + "..."


def is_integer(v: Any) -> bool:
    """An integer (Python or numpy); bools are not integers here."""
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _is_real(v: Any) -> bool:
    """A finite real number; bools and strings are not numbers here."""
    if not isinstance(v, numbers.Real) or isinstance(v, (bool, np.bool_)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def is_finite_number(v: Any) -> bool:
    """Whether `v` is a finite int or float (bool and str excluded), e.g. a request priority."""
    return _is_real(v)


def _check_int(name: str, v: Any, lo: int | None = None, hi: int | None = None, optional: bool = False) -> None:
    if v is None and optional:
        return
    if not is_integer(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f" in [{lo}, {hi}]" if lo is not None and hi is not None else (f" >= {lo}" if lo is not None else "")
        raise ValueError(f"{name} must be an integer{bounds}, got {_show(v)}")


def _check_bool(name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise ValueError(f"{name} must be a bool, got {_show(v)}")


def _check_token_ids(name: str, v: Any) -> list[int] | None:
    """A list (tuple, or 1-D integer numpy array) of token ids in [0, INT32_MAX], as plain ints."""
    if v is None:
        return None
    if isinstance(v, np.ndarray):
        if v.ndim != 1 or v.dtype.kind not in "iu":
            raise ValueError(
                f"{name} must be a 1-D integer array of token ids, got dtype {v.dtype} and shape {v.shape}"
            )
        v = v.tolist()
    if not isinstance(v, (list, tuple)):
        raise ValueError(f"{name} must be a list of integer token ids, got {type(v).__name__}")
    for t in v:
        if not is_integer(t) or not 0 <= t <= INT32_MAX:
            raise ValueError(f"{name} must hold integer token ids in [0, {INT32_MAX}], got {_show(t)}")
    return [int(t) for t in v]


def _check_strings(name: str, v: Any) -> None:
    if v is None:
        return
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise ValueError(f"{name} must be a non-empty string or a list of non-empty strings, got {_show(v)}")


@dataclass
class SamplingParams:
    """How to sample one request.

    Greedy decoding is used when temperature, top_k and top_p (and min_p) are all None,
    when temperature < 1e-5, or when top_k == 1. Otherwise unset knobs take their neutral
    value (temperature 1, top_k off, top_p 1, min_p 0). top_k of 0 or -1 means "off".
    Fields are validated at construction and again when a request is admitted
    (`validate()`), so a field changed in between cannot reach the compiled step unchecked.
    """

    end_id: Optional[int] = None
    pad_id: Optional[int] = None
    max_tokens: int = 32
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    bad: Optional[Union[str, list[str]]] = None
    bad_token_ids: Optional[list[int]] = None
    n: int = 1
    best_of: Optional[int] = None
    use_beam_search: bool = False
    # Beam search only (Hugging Face's definitions): a finished hypothesis scores
    # sum_logprobs / generated_len ** length_penalty; early_stopping True / False / "never".
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False
    temperature: Optional[float] = None
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    min_tokens: int = 0
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = True
    ignore_eos: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    logits_processor: Optional[Union[Callable, list[Callable]]] = None
    truncate_prompt_tokens: Optional[int] = None
    # A device-side batched post-processor registered on the engine
    # (`EngineConfig.logits_post_processors`), selected by name (TensorRT-LLM's
    # `logits_post_processor_name`); see `jaxllm.engine.logits_processing`.
    logits_post_processor_name: Optional[str] = None
    # Structured output: the output must match this schema / regex / grammar / choice
    # (`jaxllm.sampling.guided`); its grammar is compiled and checked at admission.
    guided_decoding: Optional[GuidedDecodingParams] = None
    # Token ids of the `bad` strings, filled by `setup(tokenizer)`.
    _bad_word_ids: Optional[list[list[int]]] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> SamplingParams:
        """Check every field (ValueError naming the field) and normalise integers and id lists
        to plain Python ints. Limits that depend on the model (vocabulary, end ids,
        max_seq_len) are checked at admission by `jaxllm.engine.admission.validate_request`."""
        _check_int("end_id", self.end_id, lo=-1, hi=INT32_MAX, optional=True)
        _check_int("pad_id", self.pad_id, lo=-1, hi=INT32_MAX, optional=True)
        _check_int("max_tokens", self.max_tokens, lo=1, hi=INT32_MAX)
        _check_int("min_tokens", self.min_tokens, lo=0, hi=INT32_MAX)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check_strings("stop", self.stop)
        _check_strings("bad", self.bad)
        for name in ("stop_token_ids", "bad_token_ids"):
            value = getattr(self, name)
            ids = _check_token_ids(name, value)
            if type(value) is not list or any(type(t) is not int for t in value):
                setattr(self, name, ids)
        _check_int("n", self.n, lo=1, hi=MAX_SEQUENCES)
        _check_int("best_of", self.best_of, lo=1, hi=MAX_SEQUENCES, optional=True)
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of must be >= n ({self.n}), got {self.best_of}")
        _check_bool("use_beam_search", self.use_beam_search)
        if not (_is_real(self.length_penalty) and abs(self.length_penalty) <= MAX_LENGTH_PENALTY):
            raise ValueError(
                f"length_penalty must be a finite number in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], "
                f"got {_show(self.length_penalty)}"
            )
        if not any(
            self.early_stopping is v or (isinstance(v, str) and self.early_stopping == v) for v in EARLY_STOPPING_VALUES
        ):
            raise ValueError(f"early_stopping must be True, False or 'never', got {_show(self.early_stopping)}")
        if self.temperature is not None and not (_is_real(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {_show(self.temperature)}")
        if self.top_k is not None:
            _check_int("top_k", self.top_k, lo=-1, hi=INT32_MAX)
        if self.top_p is not None and not (_is_real(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {_show(self.top_p)}")
        if self.min_p is not None and not (_is_real(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {_show(self.min_p)}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if v is not None and not (_is_real(v) and -2 <= v <= 2):
                raise ValueError(f"{name} must be in [-2, 2], got {_show(v)}")
        if self.repetition_penalty is not None and not (
            _is_real(self.repetition_penalty) and self.repetition_penalty > 0
        ):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {_show(self.repetition_penalty)}")
        _check_int("seed", self.seed, lo=0, hi=_MAX_SEED - 1, optional=True)
        _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS, optional=True)
        _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS, optional=True)
        _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, lo=1, optional=True)
        for name in (
            "include_stop_str_in_output",
            "return_context_logits",
            "return_generation_logits",
            "exclude_input_from_output",
            "ignore_eos",
            "detokenize",
            "add_special_tokens",
            "skip_special_tokens",
        ):
            _check_bool(name, getattr(self, name))
        # Accepted by the API for compatibility but not implemented: refused, never ignored.
        for name, unsupported in (
            ("truncate_prompt_tokens", self.truncate_prompt_tokens is not None),
            ("exclude_input_from_output", not self.exclude_input_from_output),
        ):
            if unsupported:
                raise ValueError(f"{name}: {_show(getattr(self, name))} is not supported")
        if self.guided_decoding is not None:
            if not isinstance(self.guided_decoding, GuidedDecodingParams):
                raise ValueError(
                    f"guided_decoding must be a jaxllm.GuidedDecodingParams, got {type(self.guided_decoding).__name__}"
                )
            self.guided_decoding.validate()
        if self.use_beam_search:
            self._check_beam_search()
        elif self.length_penalty != 1.0 or self.early_stopping is not False:
            name = "length_penalty" if self.length_penalty != 1.0 else "early_stopping"
            raise ValueError(f"{name} applies to beam search only: set use_beam_search=True")
        lp = self.logits_processor
        if lp is not None and not callable(lp) and not (isinstance(lp, (list, tuple)) and all(callable(f) for f in lp)):
            raise ValueError(f"logits_processor must be a callable or a list of callables, got {_show(lp)}")
        post_name = self.logits_post_processor_name
        if post_name is not None and not (isinstance(post_name, str) and post_name):
            raise ValueError(f"logits_post_processor_name must be a non-empty string, got {_show(post_name)}")
        for name in (
            "end_id",
            "pad_id",
            "max_tokens",
            "min_tokens",
            "n",
            "best_of",
            "top_k",
            "seed",
            "logprobs",
            "prompt_logprobs",
        ):
            value = getattr(self, name)
            if value is not None and type(value) is not int:
                setattr(self, name, int(value))
        return self

    def _check_beam_search(self) -> None:
        """Beam search is deterministic: it ranks continuations by the model's log-probabilities.
        Knobs that would change those (sampling, penalties, bans) or per-token outputs it does
        not produce are refused rather than ignored."""
        width = self.beam_width
        if width > MAX_BEAM_WIDTH:
            raise ValueError(
                f"use_beam_search: the beam width (best_of, else n) must be <= {MAX_BEAM_WIDTH}, got {width}"
            )
        sampled = [
            name
            for name, on in (
                ("temperature", self.temperature is not None and self.temperature >= GREEDY_TEMPERATURE_EPS),
                ("top_k", self.top_k is not None and self.top_k not in (-1, 0, 1)),
                ("top_p", self.top_p is not None and self.top_p < 1),
                ("min_p", self.min_p is not None and self.min_p > 0),
            )
            if on
        ]
        if sampled:
            raise ValueError(
                f"{sampled[0]}: beam search does not sample (it keeps the most likely beams); "
                f"leave {sampled[0]} unset or neutral with use_beam_search"
            )
        refused = [
            name
            for name, on in (
                ("repetition_penalty", self.repetition_penalty not in (None, 1.0)),
                ("presence_penalty", self.presence_penalty not in (None, 0.0)),
                ("frequency_penalty", self.frequency_penalty not in (None, 0.0)),
                ("min_tokens", self.min_tokens > 0),
                ("bad", bool(self.bad)),
                ("bad_token_ids", bool(self.bad_token_ids)),
                ("stop", bool(self.stop)),
                ("stop_token_ids", bool(self.stop_token_ids)),
                ("logprobs", self.logprobs is not None),
                ("logits_processor", self.logits_processor is not None),
                ("guided_decoding", self.guided_decoding is not None),
            )
            if on
        ]
        if refused:
            raise ValueError(
                f"{refused[0]} is not supported with use_beam_search (beams end at an end id "
                "or max_tokens, and are ranked by their raw log-probabilities)"
            )

    @property
    def beam_width(self) -> int:
        """Beams kept per step: best_of, else n (1 without beam search)."""
        if not self.use_beam_search:
            return 1
        return self.best_of if self.best_of is not None else self.n

    @property
    def wants_top_logprobs(self) -> bool:
        """Whether the sampler must return top log-probabilities for this request (logprobs > 0,
        or the candidates of beam search)."""
        return bool(self.logprobs) or self.use_beam_search

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> SamplingParams:
        """Build from user keywords, rejecting unknown names instead of silently ignoring them."""
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown argument(s) for SamplingParams: {', '.join(unknown)}")
        return cls(**kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        # Derived settings are cached; a field changed later must not leave them stale.
        object.__setattr__(self, name, value)
        self.__dict__.pop("_row", None)
        if name == "bad":  # the tokenized bad words belong to the old value
            object.__setattr__(self, "_bad_word_ids", None)

    # ---- derived settings -------------------------------------------------------------------

    @property
    def is_greedy(self) -> bool:
        return self._row.greedy

    @property
    def has_penalties(self) -> bool:
        return self._row.has_penalties

    @property
    def needs_history(self) -> bool:
        """Whether SamplingTensors.build needs this request's (prompt, output) token ids."""
        return self._row.needs_history

    @property
    def logits_processors(self) -> list[Callable]:
        """The host logits processors, in the order they run."""
        lp = self.logits_processor
        if lp is None:
            return []
        return list(lp) if isinstance(lp, (list, tuple)) else [lp]

    @property
    def wants_context_logits(self) -> bool:
        """Whether the prompt's logits must come back (context logits or prompt logprobs)."""
        return self.return_context_logits or self.prompt_logprobs is not None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @cached_property
    def _row(self) -> _Row:
        greedy = (
            (self.temperature is not None and self.temperature < GREEDY_TEMPERATURE_EPS)
            or self.top_k == 1
            or (self.temperature is None and self.top_k is None and self.top_p is None and self.min_p is None)
        )
        rep = 1.0 if self.repetition_penalty is None else float(self.repetition_penalty)
        pres = 0.0 if self.presence_penalty is None else float(self.presence_penalty)
        freq = 0.0 if self.frequency_penalty is None else float(self.frequency_penalty)
        values = (
            0.0 if greedy else (1.0 if self.temperature is None else float(self.temperature)),
            0.0 if greedy or self.top_k is None or self.top_k <= 0 else float(self.top_k),
            1.0 if greedy or self.top_p is None else float(self.top_p),
            0.0 if greedy or self.min_p is None else float(self.min_p),
            rep,
            pres,
            freq,
        )
        if len(_INTERNED_VALUES) > 4096:
            _INTERNED_VALUES.clear()
        return _Row(
            values=_INTERNED_VALUES.setdefault(values, values),
            greedy=bool(greedy),
            has_penalties=rep != 1.0 or pres != 0.0 or freq != 0.0,
            has_bad_words=bool(self.bad_token_ids or self.bad),
            needs_history=bool(
                rep != 1.0
                or pres != 0.0
                or freq != 0.0
                or self.bad
                or self.logits_processor is not None
                or self.guided_decoding is not None
            ),
            min_tokens=self.min_tokens,
        )

    # ---- tokenizer-dependent setup -----------------------------------------------------------

    def setup(self, tokenizer: Any) -> SamplingParams:
        """Tokenize the `bad` strings (each becomes one banned token sequence). Depends only
        on the tokenizer, so it is safe on a params object shared by several requests."""
        _check_strings("bad", self.bad)
        self._bad_word_ids = [
            list(tokenizer.encode(w, add_special_tokens=False))
            for w in ([self.bad] if isinstance(self.bad, str) else (self.bad or []))
        ]
        return self

    @property
    def bad_word_ids(self) -> list[list[int]]:
        """Banned token sequences: each `bad_token_ids` entry alone, then the tokenized `bad`."""
        singles = [[t] for t in (self.bad_token_ids or [])]
        if self.bad:
            if self._bad_word_ids is None:
                raise ValueError("bad: bad strings need SamplingParams.setup(tokenizer) before use")
            return singles + [s for s in self._bad_word_ids if s]
        return singles


def resolve_seed(params: Optional[SamplingParams], sequence_index: int = 0) -> int:
    """The seed a request samples with; call once at admission and keep the result.

    A request without a seed gets a fresh random one, so unseeded requests differ from each
    other. With a user seed, sequence 0 uses it as is and the other `n` sequences of the
    same request get distinct seeds derived from it, so they do not repeat sequence 0.
    """
    if params is None or params.seed is None:
        return secrets.randbits(63)
    return sequence_seed(params.seed, sequence_index)


def sequence_seed(seed: int, sequence_index: int) -> int:
    """The seed of sequence `sequence_index` of a request seeded with `seed` (0: `seed`)."""
    if sequence_index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{sequence_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def resolve_end_ids(params: Optional[SamplingParams], default_eos_ids: Sequence[int]) -> list[int]:
    """The end ids of a request: `end_id` when set (-1 meaning "no end id"), else the model's."""
    if params is None or params.end_id is None:
        return list(default_eos_ids)
    return [] if params.end_id == -1 else [params.end_id]
