"""Per-step sampling inputs as fixed-shape arrays, built on the host from SamplingParams.

Every array has leading size S = max_batch_size; rows without a request (padding) are
greedy with no penalties and no suppression, so they cost nothing and change nothing.

Whether whole computations run at all is decided here on the host and recorded as static
metadata (part of the jit cache key): `use_penalties` (also switches the history shape),
`num_top_logprobs`, `any_random`, `use_top_k_top_p` (the top-k / top-p cut) and
`use_token_bitmask` (some row follows a grammar: its allowed tokens come as a bitmask
`int32[S, ceil(V / 32)]`, a [S, 1] dummy otherwise, set by the engine with
`with_token_bitmask`; those variants compile on first use). Branching
on device instead (lax.cond) would make the GPU runtime read the predicate back to the
host mid-step, stalling the host until the model forward finishes. The price is 12
compiled variants of the sampler (2 x 2 x 3, `SAMPLER_VARIANTS`); the sampler is compiled
apart from the model, so warm-up compiles all of them cheaply.

Per-request limits of these tensors (at most `SUPPRESS_WIDTH` banned ids per step, int32
ids) are checked at admission (`jaxllm.engine.admission`), so `build` never fails for an
admitted request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from itertools import chain
from typing import Any, Optional, cast

import jax
import numpy as np

from jaxllm.sampling.params import MAX_LOGPROBS, SamplingParams

SUPPRESS_WIDTH = 16
"""Default static width K of `suppress_ids`: token ids one request may ban in one step."""

SAMPLER_VARIANTS: tuple[dict, ...] = tuple(
    dict(use_penalties=penalties, num_top_logprobs=top, any_random=random, use_top_k_top_p=sort)
    for penalties in (False, True)
    for top in (0, MAX_LOGPROBS)
    for random, sort in ((False, False), (True, False), (True, True))
)
"""Every combination of the static switches `build` can produce (keywords of `empty`)."""

GENERAL_VARIANT: dict = dict(
    use_penalties=True, num_top_logprobs=MAX_LOGPROBS, any_random=True, use_top_k_top_p=True, use_token_bitmask=True
)
"""The variant with every switch on: it handles any setting (`SamplingTensors.generalized`)."""


@jax.tree_util.register_dataclass
@dataclass
class SamplingTensors:
    # Host arrays from `build`, device arrays after `as_device` (tracers inside the jitted step).
    temperature: np.ndarray | jax.Array  # f32[S]; 0 = greedy
    top_k: np.ndarray | jax.Array  # int32[S]; 0 = off
    top_p: np.ndarray | jax.Array  # f32[S]; 1 = off
    min_p: np.ndarray | jax.Array  # f32[S]; 0 = off
    repetition_penalty: np.ndarray | jax.Array  # f32[S]; 1 = off
    presence_penalty: np.ndarray | jax.Array  # f32[S]; 0 = off
    frequency_penalty: np.ndarray | jax.Array  # f32[S]; 0 = off
    seed: np.ndarray | jax.Array  # uint32[S, 2] threefry key data (high, low word of the 64-bit seed)
    step: np.ndarray | jax.Array  # int32[S] index of the output token being generated (folded into the key)
    suppress_ids: np.ndarray | jax.Array  # int32[S, K] token ids forced to -inf; -1 = unused
    # int32[S, H] prompt ids then output ids; -1 = unused ([S, 1] without penalties)
    history_ids: np.ndarray | jax.Array
    history_is_output: np.ndarray | jax.Array  # bool[S, H] True where history_ids holds an output token
    # int32[S, ceil(V / 32)] allowed tokens (bit t % 32 of word t // 32), -1 words for rows
    # without a grammar; int32[S, 1] unused without `use_token_bitmask`.
    token_bitmask: np.ndarray | jax.Array = field(default_factory=lambda: np.full((1, 1), -1, np.int32))
    use_penalties: bool = field(default=False, metadata=dict(static=True))  # some row has a penalty
    num_top_logprobs: int = field(default=0, metadata=dict(static=True))  # 0 or MAX_LOGPROBS
    any_random: bool = field(default=False, metadata=dict(static=True))  # some row samples
    use_top_k_top_p: bool = field(default=False, metadata=dict(static=True))  # some sampled row filters
    use_token_bitmask: bool = field(default=False, metadata=dict(static=True))  # some row follows a grammar

    @property
    def batch_size(self) -> int:
        return int(self.temperature.shape[0])

    def as_device(self) -> SamplingTensors:
        data: dict[str, Any] = {
            f.name: jax.numpy.asarray(getattr(self, f.name)) for f in fields(self) if not f.metadata.get("static")
        }
        static = {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("static")}
        return SamplingTensors(**data, **static)

    def with_token_bitmask(self, bitmask: np.ndarray) -> SamplingTensors:
        """These tensors with the rows' allowed tokens `bitmask` int32[S, ceil(V / 32)]."""
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[0] != self.batch_size:
            raise ValueError(
                f"token_bitmask must be int32[{self.batch_size}, words], got {bitmask.dtype}{list(bitmask.shape)}"
            )
        return replace(self, token_bitmask=bitmask, use_token_bitmask=True)

    def generalized(self, history_len: int, bitmask_words: int) -> SamplingTensors:
        """These rows as the general variant (`GENERAL_VARIANT`: every switch on), which samples
        the same tokens: an empty history penalizes nothing, an all-ones bitmask allows every
        token, a greedy row ignores the draw and a row without top-k / top-p keeps every token.
        One compiled program then serves any setting while the best-fitting one compiles."""
        S = self.batch_size
        history_ids, history_is_output = self.history_ids, self.history_is_output
        if not self.use_penalties:
            history_ids = np.full((S, history_len), -1, np.int32)
            history_is_output = np.zeros((S, history_len), np.bool_)
        bitmask = self.token_bitmask
        if not self.use_token_bitmask:
            bitmask = np.full((S, bitmask_words), -1, np.int32)
        return replace(
            self, history_ids=history_ids, history_is_output=history_is_output, token_bitmask=bitmask, **GENERAL_VARIANT
        )

    def padded(self, rows: int) -> SamplingTensors:
        """These tensors with padding rows (greedy, no penalty, nothing banned) up to `rows` rows:
        the same tokens for the rows they hold, from a sampler compiled for more rows."""
        S = self.batch_size
        if rows < S:
            raise ValueError(f"padded: {rows} rows cannot hold these tensors' {S}")
        if rows == S:
            return self
        fill = dict(top_p=1.0, repetition_penalty=1.0, suppress_ids=-1, history_ids=-1, token_bitmask=-1)
        data: dict[str, Any] = {}
        for f in fields(self):
            if f.metadata.get("static"):
                continue
            a = np.asarray(getattr(self, f.name))
            pad = np.full((rows - S, *a.shape[1:]), fill.get(f.name, 0), a.dtype)
            data[f.name] = np.concatenate([a, pad])
        return replace(self, **data)

    @classmethod
    def empty(
        cls,
        max_batch_size: int,
        history_len: int,
        *,
        use_penalties: bool = False,
        num_top_logprobs: int = 0,
        any_random: bool = False,
        use_top_k_top_p: bool = False,
        suppress_width: int = SUPPRESS_WIDTH,
    ) -> SamplingTensors:
        """All-padding tensors of a chosen variant, with the shapes `build` gives that variant,
        so that a step can be compiled ahead of traffic."""
        if use_top_k_top_p and not any_random:
            raise ValueError("use_top_k_top_p: filtering only happens when any_random is set")
        if num_top_logprobs not in (0, MAX_LOGPROBS):
            raise ValueError(f"num_top_logprobs must be 0 or {MAX_LOGPROBS}, got {num_top_logprobs}")
        t = cls.build([], [], None, [], max_batch_size, history_len, suppress_width=suppress_width)
        H = history_len if use_penalties else 1
        return replace(
            t,
            history_ids=np.full((max_batch_size, H), -1, np.int32),
            history_is_output=np.zeros((max_batch_size, H), np.bool_),
            use_penalties=use_penalties,
            num_top_logprobs=num_top_logprobs,
            any_random=any_random,
            use_top_k_top_p=use_top_k_top_p,
        )

    @classmethod
    def build(
        cls,
        params: Sequence[Optional[SamplingParams]],
        num_generated: Sequence[int],
        histories: Optional[Sequence[Optional[tuple[Sequence[int], Sequence[int]]]]],
        eos_ids: Sequence[Optional[Sequence[int]]],
        max_batch_size: int,
        history_len: int,
        *,
        seeds: Optional[Sequence[Optional[int]]] = None,
        suppress_width: int = SUPPRESS_WIDTH,
    ) -> SamplingTensors:
        """Pack the rows of one step.

        params[i] is the request in row i (None = padding row); num_generated[i] is how many
        output tokens it already has (the index of the token sampled now); histories[i] is
        (prompt_ids, output_ids), needed when some params[i].needs_history (penalties or
        `bad` strings); eos_ids[i] are its end ids (see `resolve_end_ids`), banned until min_tokens.
        seeds[i] (from `resolve_seed` at admission) overrides params[i].seed; a sampled row
        needs one of the two. history_len (H) bounds prompt + output ids per request, so
        max_seq_len always suffices.
        """
        n = len(params)
        S = max_batch_size
        if n > S:
            raise ValueError(f"max_batch_size: {n} rows do not fit in a batch of {S}")
        if len(num_generated) < n or len(eos_ids) < n:
            raise ValueError("num_generated and eos_ids need one entry per row of params")

        # Padding rows keep the greedy / no-op defaults.
        scalars = np.zeros((S, 7), np.float64)
        scalars[:, 2] = 1.0  # top_p
        scalars[:, 4] = 1.0  # repetition_penalty
        seed = np.zeros((S, 2), np.uint32)
        step = np.zeros(S, np.int32)
        suppress = np.full((S, suppress_width), -1, np.int32)
        penalty_rows: list[tuple[int, SamplingParams]] = []
        want_logprobs = False

        live = [i for i in range(n) if params[i] is not None]
        if live:
            dense = len(live) == n  # the common case: rows 0..n-1 all live, plain slices work
            at = slice(0, n) if dense else live
            # the live rows' params (no None: `live` skips the padding rows)
            lp = cast("list[SamplingParams]", list(params) if dense else [params[i] for i in live])
            rows = [p._row for p in lp]
            v0 = rows[0].values
            if all(r.values is v0 for r in rows):
                scalars[at] = v0
            else:
                scalars[at] = np.fromiter(
                    chain.from_iterable(r.values for r in rows), np.float64, count=7 * len(rows)
                ).reshape(-1, 7)
            step[at] = list(num_generated[:n]) if dense else [num_generated[i] for i in live]

            if seeds is None:
                seed_list = [p.seed for p in lp]
            else:
                seed_list = [seeds[i] if seeds[i] is not None else p.seed for i, p in zip(live, lp)]
            if None in seed_list:
                for j, s in enumerate(seed_list):
                    if s is None:
                        if not rows[j].greedy:
                            raise ValueError(
                                f"seed: row {live[j]} samples but has no seed; pass resolve_seed(params) from admission"
                            )
                        seed_list[j] = 0
            seed_arr = np.array(seed_list, np.uint64)
            seed[at, 0] = (seed_arr >> np.uint64(32)).astype(np.uint32)
            seed[at, 1] = (seed_arr & np.uint64(0xFFFFFFFF)).astype(np.uint32)

            penalty_rows = [(i, p) for i, p, r in zip(live, lp, rows) if r.has_penalties]
            want_logprobs = any(p.wants_top_logprobs for p in lp)
            for i, p, r in zip(live, lp, rows):
                if not r.has_bad_words and num_generated[i] >= r.min_tokens:
                    continue
                ban = _banned_ids(p, num_generated[i], eos_ids[i], histories[i] if histories is not None else None, i)
                if ban:
                    if len(ban) > suppress_width:
                        raise ValueError(
                            f"suppress_width: row {i} must ban {len(ban)} token ids in one step, "
                            f"more than the supported {suppress_width}"
                        )
                    suppress[i, : len(ban)] = ban

        if penalty_rows:
            if histories is None:
                raise ValueError("histories: requests with penalties need their prompt and output ids")
            history_ids = np.full((S, history_len), -1, np.int32)
            history_is_output = np.zeros((S, history_len), np.bool_)
            for i, p in penalty_rows:
                _fill_history(history_ids, history_is_output, i, p, histories[i], history_len)
        else:
            history_ids = np.full((S, 1), -1, np.int32)
            history_is_output = np.zeros((S, 1), np.bool_)

        return cls.from_columns(
            scalars,
            seed,
            step,
            suppress,
            history_ids,
            history_is_output,
            use_penalties=bool(penalty_rows),
            num_top_logprobs=MAX_LOGPROBS if want_logprobs else 0,
        )

    @classmethod
    def from_columns(
        cls,
        scalars: np.ndarray,
        seed: np.ndarray,
        step: np.ndarray,
        suppress_ids: np.ndarray,
        history_ids: np.ndarray,
        history_is_output: np.ndarray,
        *,
        use_penalties: bool,
        num_top_logprobs: int,
    ) -> SamplingTensors:
        """The tensors from float64 `scalars[S, 7]` (temperature, top_k, top_p, min_p,
        repetition, presence and frequency penalty: `SamplingParams._row.values` per row)
        and the other arrays; the sampling switches are derived from the scalars."""
        f32 = scalars.astype(np.float32)
        sampled = scalars[:, 0] > 0
        return cls(
            temperature=f32[:, 0].copy(),
            top_k=scalars[:, 1].astype(np.int32),
            top_p=f32[:, 2].copy(),
            min_p=f32[:, 3].copy(),
            repetition_penalty=f32[:, 4].copy(),
            presence_penalty=f32[:, 5].copy(),
            frequency_penalty=f32[:, 6].copy(),
            seed=seed,
            step=step,
            suppress_ids=suppress_ids,
            history_ids=history_ids,
            history_is_output=history_is_output,
            token_bitmask=np.full((scalars.shape[0], 1), -1, np.int32),
            use_penalties=use_penalties,
            num_top_logprobs=num_top_logprobs,
            any_random=bool(sampled.any()),
            use_top_k_top_p=bool((sampled & ((scalars[:, 1] > 0) | (scalars[:, 2] < 1))).any()),
        )


def _banned_ids(
    p: SamplingParams,
    num_generated: int,
    eos: Optional[Sequence[int]],
    history: Optional[tuple[Sequence[int], Sequence[int]]],
    row: int,
) -> list[int]:
    """Token ids row `row` may not produce now: bad words always, end/stop ids before min_tokens."""
    if not p.bad_token_ids and not p.bad and num_generated >= p.min_tokens:
        return []
    ban: list[int] = []
    if num_generated < p.min_tokens:
        if eos and not p.ignore_eos:
            ban.extend(eos)
        if p.stop_token_ids:
            ban.extend(p.stop_token_ids)
    for seq in p.bad_word_ids:
        if len(seq) == 1:
            ban.append(seq[0])
            continue
        if history is None:
            raise ValueError(f"histories: row {row} has multi-token bad words and needs its token history")
        if _ends_with(history[0], history[1], seq[:-1]):
            ban.append(seq[-1])
    return list(dict.fromkeys(ban))


def _ends_with(prompt: Sequence[int], output: Sequence[int], suffix: Sequence[int]) -> bool:
    """Whether prompt + output ends with `suffix`, without concatenating the two."""
    k = len(suffix)
    if k > len(prompt) + len(output):
        return False
    from_out = min(k, len(output))
    if list(output[len(output) - from_out :]) != list(suffix[k - from_out :]):
        return False
    rest = k - from_out
    return rest == 0 or list(prompt[len(prompt) - rest :]) == list(suffix[:rest])


def _fill_history(
    ids: np.ndarray,
    is_out: np.ndarray,
    row: int,
    p: SamplingParams,
    history: Optional[tuple[Sequence[int], Sequence[int]]],
    H: int,
) -> None:
    """Prompt then output ids; prompt ids only feed the repetition penalty, so they are
    left out when that penalty is off."""
    if history is None:
        raise ValueError(f"histories: row {row} uses penalties and needs its prompt and output ids")
    prompt, output = history
    if p.repetition_penalty is None or p.repetition_penalty == 1.0:
        prompt = ()
    n_p, n_o = len(prompt), len(output)
    if n_p + n_o > H:
        raise ValueError(f"history_len: row {row} needs {n_p + n_o} history slots, more than {H}")
    if n_p:
        ids[row, :n_p] = prompt
    if n_o:
        ids[row, n_p : n_p + n_o] = output
        is_out[row, n_p : n_p + n_o] = True
