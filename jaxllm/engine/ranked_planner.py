"""The host half of attention data parallelism: one scheduler and KV block pool per rank.

With `enable_attention_dp` every attention-DP rank (device) serves its own requests from its
own KV cache (see `jaxllm.models.parallel.attention_dp` for the device side). As in TensorRT-LLM, each
rank has its own `max_batch_size` and `max_num_tokens` and its own block pool; a request
is placed on one rank when it is first scheduled and stays there (its KV blocks live
there). New requests go to the rank with the fewest requests placed on it, then the
fewest prompt tokens still to prefill, then the lowest index, which balances the ranks'
batches as requests come and go.

`AttentionDpPlanner` has the `Planner` interface the engine drives (schedule -> build ->
commit): it runs each rank's `Planner.schedule`, packs the ranks' batches into one
`StepPlan` whose `StepBatch` fields carry a leading rank axis ([D, T_rank], all ranks in
the largest token bucket any of them needs), and numbers the sampler rows rank-major
(row d * max_batch_size + i). `RankedKvCaches` is what the engine, the executor and the
metrics read as the engine's `kv_cache_manager`: per-request calls go to the request's
rank, statistics are summed over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

import numpy as np

from jaxllm.batch_builder import build_step_batch, choose_token_bucket
from jaxllm.engine.planner import PLACEHOLDER_TOKEN, Planner, PlannerOptions, StepPlan, TokenEntry
from jaxllm.engine.step_failures import BuiltStep, build_isolating_failures
from jaxllm.kv_cache import KVCacheManager
from jaxllm.kv_cache.stats import KvCacheStats
from jaxllm.llm_request import LlmRequest
from jaxllm.models.parallel.attention_dp import stack_batches
from jaxllm.sampling import SamplingTensors
from jaxllm.scheduler import SchedulerOutput


class RankAssignment:
    """Which rank each live request is placed on (request id -> rank)."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self.rank_of: dict[int, int] = {}
        self._requests: list[dict[int, LlmRequest]] = [{} for _ in range(num_ranks)]

    def place(self, request: LlmRequest) -> int:
        rank = self.rank_of.get(request.request_id)
        if rank is None:

            def load(r: int) -> tuple[int, int, int]:
                queued = sum(
                    q.orig_prompt_len - q.context_current_position
                    for q in self._requests[r].values()
                    if q.is_context_phase
                )
                return len(self._requests[r]), queued, r

            rank = min(range(self.num_ranks), key=load)
            self.rank_of[request.request_id] = rank
            self._requests[rank][request.request_id] = request
        return rank

    def release(self, request: LlmRequest) -> Optional[int]:
        rank = self.rank_of.pop(request.request_id, None)
        if rank is not None:
            self._requests[rank].pop(request.request_id, None)
        return rank

    def num_placed(self, rank: int) -> int:
        return len(self._requests[rank])


class RankedKvCaches:
    """The ranks' KV block managers seen as one (the engine's `kv_cache_manager`)."""

    def __init__(self, managers: list[KVCacheManager], assignment: RankAssignment) -> None:
        self.managers = managers
        self.assignment = assignment

    @property
    def tokens_per_block(self) -> int:
        return self.managers[0].tokens_per_block

    @property
    def max_blocks_per_seq(self) -> int:
        return self.managers[0].max_blocks_per_seq

    @property
    def num_blocks(self) -> int:
        """Blocks over all ranks."""
        return sum(m.num_blocks for m in self.managers)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return self.managers[0].blocks_for_tokens(num_tokens)

    def get_max_resource_count(self) -> int:
        """Blocks one request can ever hold: one rank's pool."""
        return min(m.get_max_resource_count() for m in self.managers)

    def _manager(self, request: LlmRequest) -> Optional[KVCacheManager]:
        rank = self.assignment.rank_of.get(request.request_id)
        return None if rank is None else self.managers[rank]

    @property
    def num_free_blocks(self) -> int:
        """Free blocks over all ranks (a request can take only its own rank's: `rank_parts`)."""
        return sum(m.num_free_blocks for m in self.managers)

    def _request_manager(self, request: LlmRequest) -> KVCacheManager:
        manager = self._manager(request)
        if manager is None:
            raise ValueError(f"request {request.request_id} is not placed on an attention-DP rank")
        return manager

    def get_num_allocated_blocks(self, request: LlmRequest) -> int:
        manager = self._manager(request)
        return 0 if manager is None else manager.get_num_allocated_blocks(request)

    def grow_for_drafts(self, request: LlmRequest, num_tokens: int) -> int:
        """`KVCacheManager.grow_for_drafts` on the request's rank."""
        return self._request_manager(request).grow_for_drafts(request, num_tokens)

    def roll_back(self, request: LlmRequest, num_tokens: int) -> int:
        """`KVCacheManager.roll_back` on the request's rank."""
        return self._request_manager(request).roll_back(request, num_tokens)

    def has_sequence(self, request: LlmRequest) -> bool:
        manager = self._manager(request)
        return manager is not None and manager.has_sequence(request)

    def free_resources(self, request: LlmRequest) -> int:
        """Free the request's blocks and its place on its rank (it is finished)."""
        manager = self._manager(request)
        self.assignment.release(request)
        return 0 if manager is None else manager.free_resources(request)

    def get_kv_cache_stats(self) -> KvCacheStats:
        stats = [m.get_kv_cache_stats() for m in self.managers]
        total = {f.name: sum(getattr(s, f.name) for s in stats) for f in fields(KvCacheStats)}
        total["tokens_per_block"] = stats[0].tokens_per_block
        looked_up = total["reused_blocks"] + total["missed_blocks"]
        total["cache_hit_rate"] = total["reused_blocks"] / looked_up if looked_up else 0.0
        return KvCacheStats(**total)

    def check_invariants(self) -> None:
        for m in self.managers:
            m.check_invariants()


@dataclass
class RankedSchedulerOutput(SchedulerOutput):
    """The ranks' scheduling decisions of one step, concatenated (rank order), with each
    rank's own output (and its recorded KV placement) kept for building the batch."""

    rank_outputs: list[SchedulerOutput] = None  # type: ignore[assignment]


class AttentionDpPlanner:
    """One `Planner` per rank behind the engine's planner interface."""

    def __init__(self, planners: list[Planner], assignment: RankAssignment) -> None:
        self.planners = planners
        self.assignment = assignment
        self.kv_cache_manager = RankedKvCaches([p.kv_cache_manager for p in planners], assignment)
        first = planners[0]
        self.max_batch_size = first.max_batch_size  # per rank
        self.max_num_tokens = first.max_num_tokens  # per rank
        self.min_token_bucket = first.min_token_bucket
        self.max_blocks_per_seq = first.max_blocks_per_seq
        self.max_seq_len = first.max_seq_len
        self.decode_batch_sizes: list[int] = []  # no small decode buckets: one bucket for all ranks
        # Speculative decoding: this step's drafts by request id (`set_drafts`, cleared by
        # `commit`); each rank packs its rows' drafts after their last token.
        self._drafts: dict[int, list[int]] = {}
        self.spec_tokens_per_row = 0  # the `Planner` attribute (no decode buckets here)
        self.sampler_row_sizes: list[int] = []  # the sampler runs over every rank's rows

    @property
    def num_ranks(self) -> int:
        return len(self.planners)

    @property
    def steady_decode(self) -> bool:
        """Whether the ranks plan steady decode steps their fast way (`Planner.steady_decode`;
        off with speculative decoding, whose rows carry drafts)."""
        return all(p.steady_decode for p in self.planners)

    @steady_decode.setter
    def steady_decode(self, value: bool) -> None:
        for planner in self.planners:
            planner.steady_decode = value

    def materialize_tokens(self) -> None:
        """Nothing to write: attention-DP steps are committed here (`commit`), one placeholder
        per token, so no rank keeps a steady batch's tokens in a `DecodeTokenLog`."""

    @property
    def num_rows(self) -> int:
        """Sampler rows of a step: max_batch_size per rank."""
        return self.num_ranks * self.max_batch_size

    def token_buckets(self) -> list[int]:
        """Per-rank token buckets (the step holds num_ranks x bucket tokens)."""
        return self.planners[0].token_buckets()

    def _split(self, requests: list[LlmRequest]) -> list[list[LlmRequest]]:
        per_rank: list[list[LlmRequest]] = [[] for _ in self.planners]
        for request in requests:
            per_rank[self.assignment.place(request)].append(request)
        return per_rank

    def schedule(
        self, candidates: list[LlmRequest], options: PlannerOptions = PlannerOptions()
    ) -> Optional[RankedSchedulerOutput]:
        """Place new requests on ranks, then schedule every rank; None when nothing runs.
        No rank keeps a token log (`options.defer_tokens` does not apply: see `commit`)."""
        options = replace(options, defer_tokens=False)
        outputs = []
        for planner, mine in zip(self.planners, self._split(candidates)):
            out = planner.schedule(mine, options) if mine else None
            outputs.append(out if out is not None else SchedulerOutput())
        if all(o.is_empty for o in outputs):
            return None
        combined = RankedSchedulerOutput(
            [r for o in outputs for r in o.context_requests],
            [r for o in outputs for r in o.generation_requests],
            [r for o in outputs for r in o.paused_requests],
            sum(o.num_fitting_requests for o in outputs),
        )
        combined.rank_outputs = outputs
        return combined

    def end_steady_batch(self) -> None:
        """Nothing to end: a speculating attention-DP engine plans every step the general way."""

    def set_drafts(self, drafts: dict[int, list[int]]) -> None:
        """Draft tokens (by request id) this step's generation requests verify (`Planner.set_drafts`)."""
        self._drafts = drafts

    def rank_parts(self, output: SchedulerOutput) -> list[tuple[SchedulerOutput, KVCacheManager]]:
        """Each rank's part of `output` with its KV block manager (rank order): the token
        budget, the block pool and the sampler rows (rank * max_batch_size + i) of each."""
        return [(part, planner.kv_cache_manager) for part, planner in zip(self._rank_outputs(output), self.planners)]

    def step_shape(self, num_tokens: int, decode_rows: Optional[int]) -> tuple[int, int]:
        """(per-rank tokens, rows per rank) of a step of `num_tokens` tokens over all ranks,
        were they spread evenly (an estimate: the adaptive drafting's step-cost key)."""
        per_rank = min(-(-num_tokens // self.num_ranks), self.max_num_tokens)
        return choose_token_bucket(per_rank, self.max_num_tokens, self.min_token_bucket), self.max_batch_size

    def spec_step_shape(self, num_tokens: int, num_rows: int) -> tuple[int, int]:
        """`step_shape` of a speculative step (attention DP has token buckets only)."""
        return self.step_shape(num_tokens, None)

    def _rank_outputs(self, output: SchedulerOutput) -> list[SchedulerOutput]:
        """Each rank's part of `output` (the recorded one when `output` is unchanged, so the
        KV placement `prepare_resources` recorded is used)."""
        ctx, gen = self._split(output.context_requests), self._split(output.generation_requests)
        recorded = getattr(output, "rank_outputs", None) or [None] * self.num_ranks
        parts = []
        for rank_ctx, rank_gen, rec in zip(ctx, gen, recorded):
            if rec is not None and rec.context_requests == rank_ctx and rec.generation_requests == rank_gen:
                parts.append(rec)
            else:
                parts.append(SchedulerOutput(rank_ctx, rank_gen))
        return parts

    def empty_batch(self, bucket: int):
        """The stacked all-padding batch of a token bucket (for compiling ahead of traffic)."""
        return stack_batches(
            [
                build_step_batch(
                    SchedulerOutput(),
                    planner.kv_cache_manager,
                    token_bucket=bucket,
                    max_batch_size=self.max_batch_size,
                    max_blocks_per_seq=self.max_blocks_per_seq,
                )
                for planner in self.planners
            ]
        )

    def empty_step(self, bucket: int):
        """An all-padding step of a token bucket and its feed index (for compiling ahead of traffic)."""
        return self.empty_batch(bucket), np.full((self.num_ranks, bucket), -1, np.int32)

    def build(self, output: SchedulerOutput, in_flight: Optional[list[TokenEntry]] = None) -> StepPlan:
        """The plan of a scheduled step: every rank's batch in one common token bucket."""
        parts = self._rank_outputs(output)
        drafts = [[self._drafts.get(r.request_id, []) for r in p.generation_requests] for p in parts]
        counts = [p.num_context_tokens + len(p.generation_requests) + sum(map(len, d)) for p, d in zip(parts, drafts)]
        bucket = max(choose_token_bucket(n, self.max_num_tokens, self.min_token_bucket) for n in counts)
        batches = []
        for part, planner, rank_drafts in zip(parts, self.planners, drafts):
            draft_lens = draft_tokens = None
            if any(rank_drafts):
                if any(r.output_token_ids[-1] == PLACEHOLDER_TOKEN for r in part.generation_requests):
                    raise ValueError("a speculative step needs every generation request's last token on the host")
                draft_lens = np.array([len(d) for d in rank_drafts], np.int32)
                draft_tokens = np.fromiter((t for d in rank_drafts for t in d), np.int32)
            batches.append(
                build_step_batch(
                    part,
                    planner.kv_cache_manager,
                    token_bucket=bucket,
                    max_batch_size=self.max_batch_size,
                    max_blocks_per_seq=self.max_blocks_per_seq,
                    draft_lens=draft_lens,
                    draft_tokens=draft_tokens,
                )
            )
        feed_index = np.full((self.num_ranks, bucket), -1, np.int32)
        prev_rows = {id(r): row for r, row, _ in in_flight or ()}
        rows: list[Optional[LlmRequest]] = [None] * self.num_rows
        for rank, part in enumerate(parts):
            num_ctx = part.num_context_tokens
            for i, request in enumerate(part.generation_requests):
                if request.output_token_ids[-1] == PLACEHOLDER_TOKEN:
                    feed_index[rank, num_ctx + i] = prev_rows[id(request)]
            for i, request in enumerate(part.all_requests()):
                rows[rank * self.max_batch_size + i] = request
        params = [None if r is None else r.sampling_params for r in rows]
        needs_history = any(p.needs_history for p in params if p is not None)
        sampling = SamplingTensors.build(
            params,
            [0 if r is None else len(r.output_token_ids) for r in rows],
            [None if r is None else (r.prompt_token_ids[: r.orig_prompt_len], r.output_token_ids) for r in rows]
            if needs_history
            else None,
            [None if r is None else r.end_ids for r in rows],
            self.num_rows,
            self.max_seq_len,
            seeds=[None if r is None else r.seed for r in rows],
        )
        num_tokens = sum(counts)
        num_ctx_tokens = sum(p.num_context_tokens for p in parts)
        return StepPlan(stack_batches(batches), sampling, feed_index, num_tokens, num_ctx_tokens)

    def build_step(self, output: SchedulerOutput, in_flight: Optional[list[TokenEntry]] = None) -> BuiltStep:
        """`build`, leaving out the requests that make it fail (`build_isolating_failures`)."""
        return build_isolating_failures(self, output, in_flight)

    def commit(self, output: SchedulerOutput) -> list[TokenEntry]:
        """Advance the scheduled requests (as `Planner.commit`), with rank-major sampler rows."""
        self._drafts = {}
        entries: list[TokenEntry] = []
        for rank, part in enumerate(self._rank_outputs(output)):
            for i, request in enumerate(part.all_requests()):
                produces_token = request.is_generation_phase or request.is_last_context_chunk
                if request.is_context_phase:
                    request.move_to_next_context_chunk()
                if produces_token:
                    entries.append((request, rank * self.max_batch_size + i, len(request.output_token_ids)))
                    request.add_new_token(PLACEHOLDER_TOKEN)
        return entries
