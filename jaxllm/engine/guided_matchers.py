"""Per-request grammar matchers (llguidance) and the token bitmask of each step.

A request with `SamplingParams.guided_decoding` gets an llguidance matcher when it is first
planned: a copy of a template matcher built once per grammar (an LRU by grammar text), so
a schema shared by many requests is compiled once. Before a step is launched, each
constrained row's matcher consumes the tokens its request committed since the last step
(they are on the host: such a request needs its token history, so the engine reads the
previous step back before planning it) and writes its allowed tokens into that row of the
step's bitmask `int32[S, ceil(V / 32)]`; rows without a grammar are all ones. The bitmask
covers the model's vocabulary V, which may be larger than the tokenizer's: ids without a
token are never allowed.

llguidance allows its stop token exactly when the grammar accepts; here that bit stands for
the request's own end ids, so a finished structure ends the request with "stop", and
max_tokens inside an unfinished one ends it with "length". A matcher is dropped when its
request finishes, fails or is aborted (`release`, called by the request table).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import llguidance
import llguidance.numpy as llnp
import numpy as np

from jaxllm.engine.token_log import PLACEHOLDER_TOKEN
from jaxllm.llm_request import LlmRequest
from jaxllm.sampling.guided import GuidedDecodingParams, compile_grammar, parser_limits

logger = logging.getLogger(__name__)

TEMPLATE_CACHE_SIZE = 256
"""Template matchers kept (one per grammar text, least recently used dropped first)."""


@dataclass
class _RequestMatcher:
    matcher: Any  # llguidance.LLMatcher
    consumed: int = 0  # output tokens fed to the matcher so far


class GuidedMatchers:
    """The matchers of the engine's constrained requests (used on the engine's thread;
    `check` may be called from any thread)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        """`tokenizer`: the model's Hugging Face tokenizer (a fast one) or None (then every
        constrained request is refused); `vocab_size`: the model's (logits) vocabulary;
        `eos_ids`: the model's end ids (llguidance's stop token)."""
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.words = (self.vocab_size + 31) // 32  # bitmask width over the model's vocabulary
        self.eos_ids = tuple(sorted(eos_ids))
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._templates: OrderedDict[str, Any] = OrderedDict()
        self._active: dict[int, _RequestMatcher] = {}
        self._executor: Any = None
        self.compile_seconds = 0.0  # building template matchers (grammar -> lexer and parser)
        self.templates_built = 0
        self.fill_seconds = 0.0  # advancing matchers and filling bitmasks

    @property
    def num_active(self) -> int:
        """Matchers held for unfinished requests."""
        return len(self._active)

    # ------------------------------------------------------------------ admission
    def check(self, guided: GuidedDecodingParams) -> None:
        """Compile `guided` for this tokenizer (cached); ValueError naming the field when it
        does not compile or cannot be served."""
        self.template(guided)

    def prepare(self) -> None:
        """Build llguidance's view of the tokenizer now (half a second for a 49K vocabulary), so
        the first constrained request does not pay it while other requests stream; nothing
        when the tokenizer cannot serve structured output (such a request is refused later)."""
        try:
            self._tokenizer()
        except Exception:  # no fast tokenizer, or no llguidance: the request names the problem
            pass

    def check_request(self, params: Any, end_ids: Sequence[int], *, attention_dp: bool = False) -> None:
        """Admission of a request with `params.guided_decoding` (ValueError naming the field):
        it must be able to end when its structure does (an end id, not ignored or banned by
        min_tokens) and its grammar must compile."""
        guided = params.guided_decoding
        if guided is None:
            return
        if attention_dp:
            raise ValueError("guided_decoding is not supported with enable_attention_dp")
        if params.ignore_eos:
            raise ValueError("ignore_eos: cannot be combined with guided_decoding (the output ends at an end id)")
        if not end_ids:
            raise ValueError("end_id: guided_decoding needs an end id to finish the output, not end_id=-1")
        if params.min_tokens:
            raise ValueError(
                "min_tokens: cannot be combined with guided_decoding (a finished structure allows only an end id)"
            )
        self.check(guided)

    def _tokenizer(self) -> Any:
        if self._ll_tokenizer is not None:
            return self._ll_tokenizer
        with self._lock:
            if self._ll_tokenizer is None:
                tok = self.tokenizer
                if tok is None or not hasattr(tok, "backend_tokenizer"):
                    raise ValueError(
                        "guided_decoding needs the model's Hugging Face fast tokenizer (tokenizer.json); "
                        "this engine has none"
                    )
                import llguidance.hf

                n_vocab = max(self.vocab_size, len(tok))
                eos = list(self.eos_ids) or tok.eos_token_id
                self._ll_tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=n_vocab, eos_token=eos)
        return self._ll_tokenizer

    def template(self, guided: GuidedDecodingParams) -> Any:
        """The matcher every request with this constraint starts from (built once, cached);
        ValueError naming the field when it does not compile. A cached one is returned without
        waiting for a compile under way on another thread (the engine's thread never waits on
        an API thread's new grammar)."""
        grammar = compile_grammar(guided)
        template = self._templates.get(grammar)
        if template is not None:
            if self._lock.acquire(blocking=False):  # recency, when nobody else holds the cache
                try:
                    if grammar in self._templates:
                        self._templates.move_to_end(grammar)
                finally:
                    self._lock.release()
            return template
        start = time.perf_counter()
        # llguidance drops the GIL while it builds the lexer and parser.
        template = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0, limits=parser_limits())
        if template.is_error():
            message = " ".join(template.get_error().split())
            raise ValueError(f"guided_decoding.{guided.field}: {message}")
        with self._lock:
            self.compile_seconds += time.perf_counter() - start
            self.templates_built += 1
            template = self._templates.setdefault(grammar, template)
            while len(self._templates) > TEMPLATE_CACHE_SIZE:
                self._templates.popitem(last=False)
        return template

    # ------------------------------------------------------------------ each step
    def sit_out(self, candidates: list[LlmRequest], in_flight: Any) -> list[LlmRequest]:
        """The candidates of the next step under the overlap scheduler: a constrained request
        whose token is still on the device sits this step out (its mask needs that token), so
        the others stay overlapped and its mask is filled while the device runs this step.
        When every candidate would sit out, all are returned (the engine then reads the step
        back first)."""
        if not self._active:
            return candidates
        busy = {id(entry[0]) for entry in in_flight if entry[0].request_id in self._active}
        if not busy:
            return candidates
        free = [r for r in candidates if id(r) not in busy]
        return free if free else candidates

    def release(self, request: LlmRequest) -> None:
        """Drop the matcher of a request that ended (no-op for one without)."""
        self._active.pop(request.request_id, None)

    def _matcher_of(self, request: LlmRequest) -> _RequestMatcher:
        state = self._active.get(request.request_id)
        if state is None:
            guided = request.sampling_params.guided_decoding
            state = self._active[request.request_id] = _RequestMatcher(self.template(guided).deep_copy())
        out = request.output_token_ids
        if state.consumed > len(out):  # outputs were cut back: start over
            state.matcher.reset()
            state.consumed = 0
        if state.consumed < len(out):
            new = [t for t in out[state.consumed :] if t not in request.end_ids]
            if PLACEHOLDER_TOKEN in new:
                raise RuntimeError("a constrained request was planned before its previous token was read back")
            if new and not state.matcher.consume_tokens(new):
                error = " ".join(state.matcher.get_error().split())
                raise ValueError(f"guided_decoding: the output does not follow the grammar: {error}")
            state.consumed = len(out)
        return state

    def fill(self, rows: Sequence[Optional[LlmRequest]], max_batch_size: int) -> Optional[np.ndarray]:
        """The step's bitmask int32[max_batch_size, ceil(V / 32)] for requests `rows` (row i is
        rows[i]; None or beyond: padding), or None when no row has a grammar. Advances each
        constrained row's matcher over its committed tokens first."""
        constrained = [
            (i, r) for i, r in enumerate(rows) if r is not None and r.sampling_params.guided_decoding is not None
        ]
        if not constrained:
            return None
        start = time.perf_counter()
        # llguidance's vocabulary is max(model's, tokenizer's) (see `_tokenizer`): its rows hold
        # at least the model's words, and ids past the tokenizer's are never allowed by it.
        ll_words = (self._tokenizer().vocab_size + 31) // 32
        buffer = np.full((max_batch_size, ll_words), -1, np.int32)
        targets = [(self._matcher_of(r).matcher, i) for i, r in constrained]
        if len(targets) == 1:
            llnp.fill_next_token_bitmask(targets[0][0], buffer, targets[0][1])
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(num_threads=max(1, min(8, os.cpu_count() or 1)))
            llnp.fill_next_token_bitmask_par(self._executor, targets, buffer)
        mask = np.ascontiguousarray(buffer[:, : self.words])
        bits = mask.view(np.uint32)
        ll_eos = self._tokenizer().eos_tokens
        for i, request in constrained:
            # llguidance's stop token(s) mean "the grammar accepts": the request's end ids.
            accepting = any(_get_bit(bits, i, e) for e in ll_eos if e < self.vocab_size)
            for e in ll_eos:
                if e < self.vocab_size:
                    _set_bit(bits, i, e, False)
            if accepting:
                for e in request.end_ids:
                    if 0 <= e < self.vocab_size:
                        _set_bit(bits, i, e, True)
        if self.vocab_size % 32:  # ids past the vocabulary in the last word: cleared for clarity
            mask[:, -1] &= np.int32((1 << (self.vocab_size % 32)) - 1)
        self.fill_seconds += time.perf_counter() - start
        return mask


def _get_bit(bits: np.ndarray, row: int, token: int) -> bool:
    return bool((int(bits[row, token >> 5]) >> (token & 31)) & 1)


def _set_bit(bits: np.ndarray, row: int, token: int, on: bool) -> None:
    flag = np.uint32(1 << (token & 31))
    if on:
        bits[row, token >> 5] |= flag
    else:
        bits[row, token >> 5] &= ~flag
