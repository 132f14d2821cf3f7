"""Per-request sampling settings kept in persistent arrays, one row per KV-cache slot.

A request's temperature, top-k/p, min-p, penalties and seed never change while it runs,
so they are written once, into the row of the KV block table the request occupies, and
each step gathers the rows of its requests with one numpy `take` instead of reading every
request's parameters again. A row is rewritten when another request takes the slot
(checked by identity, one comparison per row).

Only "plain" rows take this path: no penalties, no bad words, no min_tokens, no logprobs.
A step with any other row is built by `SamplingTensors.build`, which handles every
setting (those rows need per-step work anyway: histories, bans, logprob outputs), so both
paths produce the same tensors.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np

from jaxllm.sampling.tensors import SUPPRESS_WIDTH, SamplingTensors

_NEUTRAL = np.array([0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0])  # a padding row: greedy, no penalties


class SamplingSlots:
    """The step-invariant sampler settings of the request in each KV slot."""

    def __init__(self, num_slots: int = 64) -> None:
        num_slots = max(1, num_slots)
        self._owner: list[Any] = [None] * num_slots
        self._values = np.tile(_NEUTRAL, (num_slots, 1))  # float64 [slots, 7], SamplingTensors columns
        self._seed = np.zeros((num_slots, 2), np.uint32)  # high, low word of the 64-bit seed
        self._plain = np.zeros(num_slots, np.bool_)
        # Counts changes of the rows, so `gather` can reuse its last tensors for the same slots.
        self._version = 0
        self._last_gather: Optional[tuple] = None  # (slots array, S, width, version, tensors)
        self.last_build_plain = False  # whether the last `build` took this path (every row plain)

    def _grow(self, needed: int) -> None:
        self._version += 1
        old = len(self._owner)
        size = max(needed, 2 * old)
        self._owner += [None] * (size - old)
        self._values = np.concatenate([self._values, np.tile(_NEUTRAL, (size - old, 1))])
        self._seed = np.concatenate([self._seed, np.zeros((size - old, 2), np.uint32)])
        self._plain = np.concatenate([self._plain, np.zeros(size - old, np.bool_)])

    def _fill(self, slot: int, request: Any) -> None:
        params = request.sampling_params
        row = params._row
        seed = request.seed if request.seed is not None else params.seed
        plain = (
            not row.has_penalties
            and not row.has_bad_words
            and not row.needs_history
            and row.min_tokens == 0
            and params.logprobs is None
            and not params.use_beam_search
            and (seed is not None or row.greedy)
        )
        self._version += 1
        self._owner[slot] = request
        self._values[slot] = row.values
        seed = 0 if seed is None else seed
        self._seed[slot] = (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF
        self._plain[slot] = plain

    def build(
        self,
        requests: Sequence[Any],
        slots: Sequence[int],
        max_batch_size: int,
        history_len: int,
        general: Callable[[], SamplingTensors],
        *,
        suppress_width: int = SUPPRESS_WIDTH,
    ) -> SamplingTensors:
        """The sampling tensors of a step whose row i is `requests[i]`, held in KV slot
        `slots[i]`; `general()` builds them the general way when some row is not plain."""
        n = len(requests)
        S = max_batch_size
        if n > S:
            raise ValueError(f"max_batch_size: {n} rows do not fit in a batch of {S}")
        if n and max(slots) >= len(self._owner):
            self._grow(max(slots) + 1)
        owner = self._owner
        for request, slot in zip(requests, slots):
            if owner[slot] is not request:
                self._fill(slot, request)
        idx = np.asarray(slots, dtype=np.intp).reshape(n)
        self.last_build_plain = self.all_plain(idx)
        if not self.last_build_plain:
            return general()
        step = np.fromiter((len(r.output_token_ids) for r in requests), np.int32, n)
        return self.gather(idx, step, S, suppress_width=suppress_width)

    def all_plain(self, slots: np.ndarray) -> bool:
        """Whether every row in `slots` takes this path (no setting that needs `general`)."""
        return bool(self._plain[slots].all())

    def gather(
        self, slots: np.ndarray, step: np.ndarray, max_batch_size: int, *, suppress_width: int = SUPPRESS_WIDTH
    ) -> SamplingTensors:
        """The tensors of plain rows already filled for their requests (`build` fills them;
        a steady decode batch keeps its slots): row i is slot `slots[i]`, generating its
        output token number `step[i]`."""
        n = slots.shape[0]
        S = max_batch_size
        steps = np.zeros(S, np.int32)
        steps[:n] = step
        last = self._last_gather
        if (
            last is not None
            and last[0] is slots
            and last[1] == S
            and last[2] == suppress_width
            and last[3] == self._version
        ):
            # The same rows as the last call (a steady decode batch): only the step changed.
            tensors = copy.copy(last[4])  # cheaper than dataclasses.replace, which re-runs __init__
            tensors.step = steps
            return tensors
        scalars = np.empty((S, 7), np.float64)
        np.take(self._values, slots, axis=0, out=scalars[:n])
        scalars[n:] = _NEUTRAL
        seed = np.zeros((S, 2), np.uint32)
        np.take(self._seed, slots, axis=0, out=seed[:n])
        tensors = SamplingTensors.from_columns(
            scalars,
            seed,
            steps,
            np.full((S, suppress_width), -1, np.int32),
            np.full((S, 1), -1, np.int32),
            np.zeros((S, 1), np.bool_),
            use_penalties=False,
            num_top_logprobs=0,
        )
        # Its arrays are never written after this (a step's inputs are copied when packed).
        self._last_gather = (slots, S, suppress_width, self._version, tensors)
        return tensors

    def release(self, slot: Optional[int] = None) -> None:
        """Forget the owner of `slot` (every slot when None); the next step refills it."""
        self._version += 1
        if slot is None:
            self._owner = [None] * len(self._owner)
        else:
            self._owner[slot] = None
