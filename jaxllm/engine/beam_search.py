"""Host side of beam search: choosing the next beams and the finished hypotheses.

Each step the device returns, for every running beam of a request, its `2 * beam_width`
most likely next tokens with their log-probabilities (the sampler's top-logprob output: a
fixed-shape `top_k` per row, compiled once). The best `2 * beam_width` continuations over
beams x vocabulary are among those (a continuation outside its own row's top `2k` is
beaten by `2k` others of the same beam), so the host merges `k * 2k` numbers instead of
`k * vocab`.

The selection follows Hugging Face's `GenerationMixin._beam_search` (transformers 5.x)
step for step, so the same model gives the same beams and scores:
  * the `2k` best continuations by accumulated log-probability; one "hits the stopping
    criteria" if its token is an end id or it reaches `max_tokens`;
  * the next running beams are the best `k` continuations that did not hit;
  * a continuation that hit and ranks among the first `k` becomes a finished hypothesis
    with score `sum_logprobs / generated_len ** length_penalty` (the end token counted),
    and the best `k` hypotheses are kept;
  * `early_stopping=True` stops once `k` hypotheses exist; False and "never" stop once the
    best running beam cannot beat the worst kept hypothesis (estimated at the current
    length, or for "never" with a positive length penalty at `max_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from jaxllm.engine.device_reads import all_to_host
from jaxllm.engine.step_updates import RequestUpdate
from jaxllm.llm_request import LlmRequest, LlmRequestState

if TYPE_CHECKING:  # pragma: no cover
    from jaxllm.engine.requests import RequestTable
    from jaxllm.engine.step_output import PendingStep

_COMPLETE = LlmRequestState.GENERATION_COMPLETE

_NEG = -1.0e9  # Hugging Face's "impossible" score


@dataclass
class BeamHypothesis:
    """One returned beam: its generated tokens (an end token included), score and finish reason."""

    token_ids: list[int]
    score: float
    finish_reason: str


@dataclass
class BeamSearch:
    """The beam state of one request (host only)."""

    beam_width: int
    max_new_tokens: int
    end_ids: frozenset
    length_penalty: float = 1.0
    early_stopping: Union[bool, str] = False
    # Running beams: generated tokens and accumulated log-probability.
    tokens: list[list[int]] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    # The k best finished hypotheses so far (slot kept at _NEG while empty), best first.
    finished: list[tuple[float, list[int], bool]] = field(default_factory=list)
    heuristic_unsatisfied: bool = True
    done: bool = False
    num_generated: int = 0

    def __post_init__(self) -> None:
        k = self.beam_width
        self.tokens = [[] for _ in range(k)]
        self.scores = [0.0] + [_NEG] * (k - 1)  # the first step continues beam 0 only
        self.finished = [(_NEG, [], False) for _ in range(k)]

    @property
    def num_candidates(self) -> int:
        """Continuations looked at per step (`2k`, as Hugging Face with one end id)."""
        return 2 * self.beam_width

    def step(self, top_ids: np.ndarray, top_logprobs: np.ndarray) -> list[tuple[int, int]]:
        """Advance one token. `top_ids` / `top_logprobs`: [rows, >= 2k] per running beam, best
        first (one row before the first token: every beam starts as beam 0). Returns the next
        running beams as (parent beam, new token); `done` tells whether the search ended."""
        k, c = self.beam_width, self.num_candidates
        rows = 1 if self.num_generated == 0 else k
        ids = np.asarray(top_ids)[:rows, :c].astype(np.int64)
        acc = np.asarray(top_logprobs, np.float32)[:rows, :c] + np.asarray(self.scores[:rows], np.float32)[:, None]
        flat = acc.ravel()
        # Best first; ties by beam then token rank (torch.topk over beams x vocab).
        order = np.lexsort((np.arange(flat.size), -flat))[:c]
        cand_beam = (order // c).tolist()
        cand_tok = ids.ravel()[order].tolist()
        cand_score = flat[order].astype(np.float32)
        length = self.num_generated + 1
        hits = np.array([t in self.end_ids or length >= self.max_new_tokens for t in cand_tok])
        # Next running beams: the best k continuations that did not hit a stop.
        running = cand_score + hits.astype(np.float32) * np.float32(_NEG)
        nxt = np.lexsort((np.arange(c), -running))[:k]
        # Finished hypotheses: continuations that hit, ranked among the first k. Hugging Face
        # adds -1e9 to the rest and merges them all; here only real hypotheses are merged (the
        # same ranking for scores above -1e9), so a strong length penalty that pushes a real
        # score below -1e9 cannot let an empty slot or an unfinished beam outrank it.
        penalised = cand_score / np.float32(length**self.length_penalty)
        full = all(f for _, _, f in self.finished) and self.early_stopping is True
        just_finished = hits & (np.arange(c) < k)
        real = [entry for entry in self.finished if entry[2]]
        if self.heuristic_unsatisfied and not full:
            real += [
                (float(penalised[i]), self.tokens[cand_beam[i]] + [cand_tok[i]], True)
                for i in range(c)
                if just_finished[i]
            ]
        merged_scores = np.array([m[0] for m in real], np.float32)
        keep = np.lexsort((np.arange(len(real)), -merged_scores))[:k]
        self.finished = [real[i] for i in keep] + [(_NEG, [], False)] * (k - min(k, len(real)))
        parents = [(cand_beam[i], cand_tok[i]) for i in nxt]
        self.tokens = [self.tokens[cand_beam[i]] + [cand_tok[i]] for i in nxt]
        self.scores = [float(running[i]) for i in nxt]
        self.num_generated = length
        # Can a running beam still beat the worst kept hypothesis?
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_len = self.max_new_tokens
        else:
            best_len = length
        best_possible = np.float32(self.scores[0]) / np.float32(best_len**self.length_penalty)
        filled = all(f for _, _, f in self.finished)
        worst = min(s for s, _, _ in self.finished)
        self.heuristic_unsatisfied = self.heuristic_unsatisfied and (not filled or best_possible > np.float32(worst))
        open_beam = not (all(f for _, _, f in self.finished) and self.early_stopping is True)
        self.done = not (self.heuristic_unsatisfied and open_beam and not hits.all())
        return parents

    def results(self, n: int) -> list[BeamHypothesis]:
        """The n best hypotheses, best first."""
        return [
            BeamHypothesis(list(tokens), float(score), "stop" if tokens and tokens[-1] in self.end_ids else "length")
            for score, tokens, _ in self.finished[:n]
        ]


@dataclass(eq=False)
class BeamRun:
    """A running beam-search request: its search state and its beams' requests (beam 0 is
    the request itself; the others exist once the prompt is done)."""

    search: BeamSearch
    requests: list
    num_returned: int


def beam_id(request_id: int, beam: int) -> int:
    """Id of beam `beam` (>= 1) of a request in the KV cache manager: negative, so it never
    meets a request id."""
    return -1 - (request_id * 8 + beam)


# ---------------------------------------------------------------------- the engine's beam step
def advance_beams(
    requests: RequestTable, kv: Any, copy_blocks: Callable[[list[tuple[int, int]]], None], pending: PendingStep
) -> list[RequestUpdate]:
    """Choose each beam-search request's next beams from its rows' top candidates, fork
    their KV blocks in `kv` (copying shared partial blocks on the device with
    `copy_blocks`), or finish it in `requests`."""
    out = pending.sampler_output
    top_ids, top_logprobs = all_to_host(out.top_ids, out.top_logprobs)
    rows_of: dict[LlmRequest, list[int]] = {}
    for request, row, _ in pending.beam_entries:
        leader = request.beam.requests[0]
        rows_of.setdefault(leader, []).append(row)
    updates = []
    for leader, rows in rows_of.items():
        if leader.state is _COMPLETE:
            continue
        try:
            updates += _advance_one(requests, kv, copy_blocks, leader, rows, top_ids, top_logprobs)
        except Exception as exc:  # host bookkeeping of one request: fail it alone
            updates += requests.fail([leader], exc, "choosing the next beams")
    return updates


def _advance_one(
    requests: RequestTable,
    kv: Any,
    copy_blocks: Callable[[list[tuple[int, int]]], None],
    leader: LlmRequest,
    rows: list[int],
    top_ids: np.ndarray,
    top_logprobs: np.ndarray,
) -> list[RequestUpdate]:
    run: BeamRun = leader.beam
    search = run.search
    parents = search.step(top_ids[rows], top_logprobs[rows])
    if search.done:
        results = search.results(run.num_returned)
        best = results[0]
        leader.output_token_ids[:] = best.token_ids
        requests.finish(leader, best.finish_reason, None, len(best.token_ids))
        return [RequestUpdate(leader, list(best.token_ids), finished=True, beam_outputs=results)]
    if len(run.requests) < search.beam_width:  # the prompt is done: the other beams start from it
        beams = []
        for j in range(1, search.beam_width):
            beam = LlmRequest(
                request_id=beam_id(leader.request_id, j),
                prompt_token_ids=leader.prompt_token_ids,
                max_new_tokens=leader.max_new_tokens,
                priority=leader.priority,
                arrival_time=leader.arrival_time,
                sampling_params=leader.sampling_params,
                state=LlmRequestState.GENERATION_IN_PROGRESS,
            )
            beam.context_current_position = leader.prompt_len
            beam.seed, beam.end_ids, beam.beam = leader.seed, leader.end_ids, run
            beam.lora_adapter = leader.lora_adapter
            beam.kv_cache_retention_config = leader.kv_cache_retention_config
            beams.append(beam)
        kv.add_beams(leader, beams)
        run.requests.extend(beams)
    cached = leader.prompt_len + search.num_generated - 1  # the newest token is fed next step
    copies = kv.fork_beams(leader, [p for p, _ in parents], cached)
    for beam, tokens in zip(run.requests, search.tokens):
        beam.output_token_ids[:] = tokens
    if copies:
        copy_blocks(copies)
    return []
