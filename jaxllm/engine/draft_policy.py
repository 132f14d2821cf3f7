"""Adaptive drafting: which rows draft how many tokens, and whether a step drafts at all.

Speculation pays only when a verifying step emits more tokens per second than the step
without drafts; on a device where a forward of 1 + k tokens per row costs much more than one
token (a compute-bound CPU, a large batch) it may not. `DraftPolicy` keeps:

* per request, decayed counts of accepted and tried drafts: a row drafts only the positions
  whose estimated acceptance (its rate to the power of the position) is at least
  `MIN_DRAFT_ACCEPTANCE`;
* per step shape (kind, tokens, rows), the measured seconds of the engine's steps: a step
  drafts only when its expected tokens (sum over rows of 1 + rate + rate^2 + ...) per second
  beat the plain step's tokens per second by `MIN_GAIN`, trying the shape not chosen every `EXPLORE_EVERY`
  decisions so both estimates stay fresh;
* a back-off: after a step that did not draft, drafting is not tried for 1, 2, 4, ... up to
  `MAX_BACKOFF` steps (those steps keep the overlap scheduler; trying needs a read-back);
* with `shared_prior` (a drafter: MTP layers, a draft model, an EAGLE-3 head, whose quality is
  the drafter's more than the request's), decayed counts over all rows: a new request starts
  from them instead of `PRIOR_ACCEPTANCE`, and while they fall below `MIN_DRAFT_ACCEPTANCE` or
  the last step-cost verdict on drafting at full lengths was against it, the drafter is not
  worth running even over prompts (`drafting_alive`). Steps that verify nothing pull those counts back towards the prior
  (`SHARED_RECOVERY` per observed step), so drafting is tried again after a few hundred steps;
* a drafter's own measured costs, charged to the step-cost decision: its drafting program
  (keyed by the shape of the step it runs over: `drafter_ran`), and its runs over prompt
  chunks (`prompt_ran`), spread over the output tokens the prompts' requests may produce
  (their remaining `max_tokens`: an upper bound, so the charge errs towards drafting). A
  drafting step must pay for both; when drafting at full lengths does not, the prompt runs stop
  too (`drafting_alive`), and step shapes not measured yet are not tried, until an exploring
  step drafts again.

TensorRT-LLM and vLLM adapt the draft length too (by acceptance and by batch size); this one
measures the step times instead of assuming a cost model.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import Any, Optional

MIN_DRAFT_ACCEPTANCE = 0.2
PRIOR_ACCEPTANCE = 0.6  # a request's acceptance rate before it verified anything (3 drafts)
EXPLORE_EVERY = 50
MAX_BACKOFF = 32
# A drafting step must promise this much more tokens per second than the plain step (step times
# are noisy; a wrong choice for drafting costs more than a wrong choice against it).
MIN_GAIN = 1.1
SHARED_RECOVERY = 0.995  # per step without a verified draft: the shared counts' decay
PROMPT_DECAY = 0.9  # per prompt run: the decay of the drafter's prompt seconds and tokens


@dataclass
class Acceptance:
    """A request's decayed counts of accepted and tried drafts."""

    accepted: float = 0.0
    tried: float = 0.0

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR_ACCEPTANCE) / (self.tried + 1.0)

    def update(self, accepted: int, tried: int, decay: float = 0.8) -> None:
        self.accepted = self.accepted * decay + accepted
        self.tried = self.tried * decay + tried


def expected_tokens(rate: float, k: int) -> float:
    """Expected tokens a row of k drafts emits when each is accepted with probability `rate`."""
    return float(sum(rate**j for j in range(k + 1)))


class DraftPolicy:
    """Decides drafting per row and per step (engine thread only)."""

    def __init__(self, planner: Any, max_draft_len: int = 0) -> None:
        """`planner`: gives the shapes steps run in (`step_shape`, `spec_step_shape`);
        `max_draft_len`: the config's (whether drafting pays is judged at full lengths)."""
        self.planner = planner
        self.max_draft_len = max_draft_len
        self.adaptive = True  # False: every eligible row drafts all it can, every step
        self._acceptance: dict[int, Acceptance] = {}
        self._costs: dict[tuple, float] = {}
        self._last_key: Optional[tuple] = None
        self._decisions = 0
        self._skip = 0  # steps left before drafting is tried again
        self._backoff = 1  # the next back-off
        self.shared_prior = False  # new requests start from every row's counts (drafters)
        self._shared = Acceptance()
        # The last step-cost verdict on drafting at full lengths (a step near its requests'
        # max_tokens drafts fewer tokens and may not pay; that says nothing of the drafter).
        self._drafting_pays: Optional[bool] = None
        self._drafter_costs: dict[tuple, float] = {}  # a drafter's program over a step, by its shape
        self._prompt_seconds = 0.0  # decayed seconds of a drafter's runs over prompt chunks
        self._prompt_tokens = 0.0  # decayed output tokens those prompts' requests may produce

    def draft_len(self, request_id: int, k: int) -> int:
        """How many of at most `k` drafts the request should verify."""
        if not self.adaptive:
            return k
        rate = self._acceptance.get(request_id, self._prior()).rate
        j = 0
        while j < k and rate ** (j + 1) >= MIN_DRAFT_ACCEPTANCE:
            j += 1
        return j

    def verified(self, request_id: int, accepted: int, drafted: int) -> None:
        """A row verified `drafted` drafts and accepted the first `accepted`."""
        tried = accepted + (1 if accepted < drafted else 0)
        self._acceptance.setdefault(request_id, self._prior()).update(accepted, tried)
        self._shared.update(accepted, tried)

    def _prior(self) -> Acceptance:
        """A new request's counts: the shared ones with `shared_prior`, else none (the prior)."""
        shared = self._shared
        return Acceptance(shared.accepted, shared.tried) if self.shared_prior else Acceptance()

    def drafting_alive(self) -> bool:
        """Whether a drafter is worth running at all (over prompts too): always without
        adaptive drafting or `shared_prior`; else while a new request would draft and the last
        step-cost decision was not against drafting."""
        if not self.adaptive or not self.shared_prior:
            return True
        return self._shared.rate >= MIN_DRAFT_ACCEPTANCE and self._drafting_pays is not False

    def forget(self, active: Container[int], keep: int) -> None:
        """Drop finished requests' rates once more than `keep` are kept."""
        if len(self._acceptance) > keep:
            for rid in [rid for rid in self._acceptance if rid not in active]:
                del self._acceptance[rid]

    def _plain_key(self, num_ctx: int, num_gen: int) -> tuple:
        return ("plain", *self.planner.step_shape(num_ctx + num_gen, None if num_ctx else num_gen))

    def _spec_key(self, num_ctx: int, num_gen: int, num_drafts: int) -> tuple:
        tokens = num_ctx + num_gen + num_drafts
        if num_ctx:
            return ("spec", *self.planner.step_shape(tokens, None))
        return ("spec", *self.planner.spec_step_shape(tokens, num_gen))

    def drafter_ran(self, shape: tuple[int, int], seconds: float) -> None:
        """A drafter's program ran over a step of `shape` (tokens, rows) without prompt tokens."""
        key = ("draft", *shape)
        old = self._drafter_costs.get(key)
        self._drafter_costs[key] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def _drafter_cost(self, shape: tuple[int, int]) -> float:
        """The drafter's measured program time over a step of `shape`; for a shape not measured
        yet, that of the nearest measured shape (by tokens, then rows), 0.0 before any."""
        key = ("draft", *shape)
        cost = self._drafter_costs.get(key)
        if cost is not None or not self._drafter_costs:
            return cost or 0.0
        nearest = min(self._drafter_costs, key=lambda k: (abs(k[1] - shape[0]), abs(k[2] - shape[1])))
        return self._drafter_costs[nearest]

    def prompt_ran(self, seconds: float, tokens: int) -> None:
        """A drafter's program ran over a step with prompt tokens, taking `seconds`; `tokens`:
        the output tokens the requests whose prompts that step started may still produce."""
        self._prompt_seconds = PROMPT_DECAY * self._prompt_seconds + seconds
        self._prompt_tokens = PROMPT_DECAY * self._prompt_tokens + tokens

    @property
    def prompt_seconds_per_token(self) -> float:
        """A drafter's prompt runs, in seconds per output token they may serve (0.0: none yet)."""
        if self._prompt_seconds <= 0.0:
            return 0.0
        return self._prompt_seconds / max(self._prompt_tokens, 1.0)

    def worth_it(
        self,
        output: Any,
        drafts: dict[int, list[int]],
        num_ctx: int,
        drafter_shape: Optional[tuple[int, int]] = None,
    ) -> bool:
        """Whether drafting `drafts` this step is expected to emit more tokens per second than
        the same step without them. `drafter_shape`: the shape of the step a drafter must run
        over for these drafts (its measured program time is charged), None when nothing runs
        for them alone; a drafter's prompt runs are charged per expected token."""
        if not self.adaptive:
            return True
        gen = output.generation_requests
        plain_cost = self._costs.get(self._plain_key(num_ctx, len(gen)))
        spec_cost = self._costs.get(self._spec_key(num_ctx, len(gen), sum(map(len, drafts.values()))))
        self._decisions += 1
        if plain_cost is None:
            return False  # measure the plain step first
        if spec_cost is None:  # measure a new shape, unless it would revive a drafter judged not worth it
            return not (self.shared_prior and self._drafting_pays is False)
        prior = self._prior()
        gain = sum(
            expected_tokens(self._acceptance.get(r.request_id, prior).rate, len(drafts.get(r.request_id, ())))
            for r in gen
        )
        drafter_cost = self._drafter_cost(drafter_shape) if drafter_shape else 0.0
        per_token = self.prompt_seconds_per_token
        worth = gain / (spec_cost + drafter_cost + per_token * gain) > MIN_GAIN * len(gen) / plain_cost
        # The same at the lengths the rows would draft but for max_tokens and the step's budget.
        pays = worth
        if self.max_draft_len:
            full = {rid: self.draft_len(rid, self.max_draft_len) for rid in drafts}
            full_gain = sum(
                expected_tokens(self._acceptance.get(r.request_id, prior).rate, full.get(r.request_id, 0)) for r in gen
            )
            full_cost = spec_cost
            if num_ctx + len(gen) + sum(full.values()) <= self.planner.max_num_tokens:
                full_cost = self._costs.get(self._spec_key(num_ctx, len(gen), sum(full.values())), spec_cost)
            full_cost += drafter_cost + per_token * full_gain
            pays = full_gain / full_cost > MIN_GAIN * len(gen) / plain_cost
        if self._decisions % EXPLORE_EVERY == 0:
            worth = not worth  # refresh the estimate of the shape not chosen
            pays = pays or worth  # and give a drafter judged not worth running another try
        self._drafting_pays = pays
        return worth

    def proposed(self, drafted: bool) -> None:
        """A step was proposed for: it drafts (back-off reset) or not (back-off grows)."""
        if drafted:
            self._backoff = 1
        else:
            self._skip, self._backoff = self._backoff, min(2 * self._backoff, MAX_BACKOFF)

    def wants_drafts(self) -> bool:
        """Whether the next step should try drafting (then the engine has every last token
        read back first); counts the back-off down otherwise."""
        if not self.adaptive:
            return True
        if self._skip > 0:
            self._skip -= 1
            return False
        return True

    def planned(self, kind: str, tokens: int, rows: int) -> None:
        """The shape of the step just dispatched (its time is observed next)."""
        self._last_key = (kind, tokens, rows)

    def observe(self, seconds: float) -> None:
        """The wall time of the engine's step that dispatched the step last `planned` (with
        the overlap scheduler: about the device time of the step before it)."""
        self._shared.accepted *= SHARED_RECOVERY  # drifts back towards the prior while idle
        self._shared.tried *= SHARED_RECOVERY
        key = self._last_key
        if key is None:
            return
        old = self._costs.get(key)
        self._costs[key] = seconds if old is None else 0.8 * old + 0.2 * seconds
        self._last_key = None
