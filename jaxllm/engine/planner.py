"""The host half of a step: scheduler + KV block manager + batch building -> a `StepPlan`.

A `StepPlan` holds only numpy arrays and scalars: everything the device side needs to run
one step, and nothing that refers to a request object. It is what a leader process would
send to its followers in a multi-host run; `ModelRunner.execute(plan)` runs it on the mesh.
The planner never touches a device (it imports no backend and allocates no device memory),
so it can be run, timed and tested alone.

One step is planned in three calls, so failures can be isolated between them: `schedule`
(scheduling decision + KV blocks, under the step's `PlannerOptions`), `build` (the plan;
reads requests, changes none; `build_step` finds and leaves out the requests that make it
fail) and `commit` (moves the scheduled requests forward: prompt chunks advance, requests
that will get a token carry a placeholder until the runner's output is read back).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from operator import attrgetter, itemgetter
from typing import Optional

import numpy as np

from jaxllm.batch_builder import (
    build_decode_batch,
    build_step_batch,
    choose_decode_rows,
    choose_token_bucket,
    token_buckets,
)
from jaxllm.engine.guided_matchers import GuidedMatchers
from jaxllm.engine.step_failures import BuiltStep, build_isolating_failures
from jaxllm.engine.step_plan import DecodeEntries, PlannerOptions, StepPlan, TokenEntry
from jaxllm.engine.token_log import PLACEHOLDER_TOKEN, DecodeTokenLog
from jaxllm.kv_cache import KVCacheManager
from jaxllm.kv_cache.manager import DecodeRows
from jaxllm.llm_request import LlmRequest, LlmRequestState
from jaxllm.lora.slots import NO_SLOT, LoraSlots
from jaxllm.sampling import SamplingTensors
from jaxllm.sampling.slots import SamplingSlots
from jaxllm.scheduler import SchedulerOutput
from jaxllm.scheduler.capacity import GuaranteedNoEvictScheduler, StaticBatchScheduler
from jaxllm.scheduler.micro_batch import MicroBatchScheduler
from jaxllm.scheduler.simple import SimpleScheduler
from jaxllm.step_batch import StepBatch

_GENERATION_IN_PROGRESS = LlmRequestState.GENERATION_IN_PROGRESS
_GENERATION_TO_COMPLETE = LlmRequestState.GENERATION_TO_COMPLETE

_output_token_ids = attrgetter("output_token_ids")
_feed_row = attrgetter("feed_row")
_last = itemgetter(-1)
_DEFAULT_OPTIONS = PlannerOptions()


@dataclass
class PlannedStep:
    """A plan with the host bookkeeping the engine needs once its tokens are back."""

    plan: StepPlan
    output: SchedulerOutput
    entries: list[TokenEntry] | DecodeEntries = field(default_factory=list)


class Planner:
    def __init__(
        self,
        *,
        scheduler,
        kv_cache_manager: KVCacheManager,
        max_batch_size: int,
        max_num_tokens: int,
        min_token_bucket: int,
        max_blocks_per_seq: int,
        max_seq_len: int,
        lora_slots: Optional[LoraSlots] = None,
        decode_batch_sizes: Sequence[int] = (),
    ) -> None:
        """`lora_slots`: the adapter slots when the engine serves LoRA adapters (every plan then
        carries each token's slot, `StepBatch.lora_slots`). `decode_batch_sizes`: the row counts
        of the small decode buckets (a decode-only step of n rows runs in the smallest holding n,
        as n' tokens and n' rows; see `jaxllm.batch_builder.decode_batch_sizes`)."""
        self.scheduler = scheduler
        self.lora_slots = lora_slots
        self.kv_cache_manager = kv_cache_manager
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.min_token_bucket = min_token_bucket
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_seq_len = max_seq_len
        self.decode_batch_sizes = sorted(decode_batch_sizes)
        # Sampling settings per KV slot, gathered each step instead of re-read from each request.
        self.sampling_slots = SamplingSlots(kv_cache_manager.block_table.shape[0])
        # Matchers of requests with guided decoding: their rows' token bitmask (set by the engine).
        self.guided_matchers: Optional[GuidedMatchers] = None
        self._options = PlannerOptions()  # of the step being planned (see `schedule`)
        # Per-slot arrays of the last decode-only step (see `schedule`).
        self._decode: Optional[DecodeRows] = None
        # Speculative decoding: draft tokens of this step's generation requests by request id
        # (`set_drafts`, between `schedule` and `build`; cleared by `commit`).
        self._drafts: dict[int, list[int]] = {}
        # Query tokens per row of a speculative decode bucket (1 + max_draft_len; 0: none): a
        # generation-only speculative step of n rows runs in the decode bucket of n' rows with
        # n' * this many tokens, so its logits stay [n', V] (see `spec_step_shape`).
        self.spec_tokens_per_row = 0
        self.token_log_capacity = 64  # steps a log holds before writing them into the requests
        # Row counts the sampler of a step in a token bucket (max_batch_size rows) may run over:
        # the smallest holding the step's rows, not max_batch_size (`sampler_rows`). Empty: off.
        self.sampler_row_sizes: list[int] = []
        # Steady decode steps skip the scheduler only with schedulers whose decision for such
        # a batch is that whole batch, in order: every started request keeps its place and
        # nothing is paused. Setting it False plans every step the general way.
        self.steady_decode = (
            type(scheduler) is SimpleScheduler
            and type(scheduler.micro_batch_scheduler) is MicroBatchScheduler
            and type(scheduler.capacity_scheduler) in (GuaranteedNoEvictScheduler, StaticBatchScheduler)
        )

    def token_buckets(self) -> list[int]:
        """Every token-buffer size a plan can have (one compiled model forward each)."""
        return token_buckets(self.max_num_tokens, self.min_token_bucket)

    def schedule(
        self, candidates: list[LlmRequest], options: PlannerOptions = _DEFAULT_OPTIONS
    ) -> Optional[SchedulerOutput]:
        """Choose the step's requests and give them KV blocks; None when nothing runs.
        `options` hold for this step's `build` and `commit` too.

        Steady decode: when the candidates are exactly the generation requests of the
        previous step (same requests, same order, none freed since) and the scheduler is
        the built-in no-evict one, its decision is known (all of them, in that order) and
        the KV blocks are prepared from per-slot arrays (`KVCacheManager.prepare_decode`).
        Such requests change only by the committed steps (one token each) and by writing
        sampled tokens over their placeholders; finishing, aborting or pausing one frees
        its KV blocks, which ends the steady batch."""
        self._options = options
        kv = self.kv_cache_manager
        decode = self._decode
        if (
            decode is not None
            and self.steady_decode
            and not options.beam_search
            and kv.decode_rows_current(decode)
            and candidates == decode.requests
        ):
            output = SchedulerOutput([], candidates, [], len(candidates))
            log = decode.log
            kv.prepare_decode(output, decode, None if log is None or not log.live else log.flush_rows)
            return output
        self.materialize_tokens()
        self._decode = None
        # Requests whose onboarded KV blocks are still arriving sit out (the set is live: a request
        # admitted in this very call may join it).
        output = self.scheduler.schedule_request(candidates, kv.waiting_request_ids)
        for paused in output.paused_requests:
            kv.free_resources(paused)
            if self.lora_slots is not None:
                self.lora_slots.release(paused)
        if output.is_empty:
            return None
        if options.beam_search:
            self.expand_beams(output)
        kv.prepare_resources(output)
        if (
            self.steady_decode
            and not options.beam_search
            and not output.context_requests
            and not output.paused_requests
        ):
            self._decode = kv.decode_rows(output)
        return output

    @staticmethod
    def expand_beams(output: SchedulerOutput) -> None:
        """A beam-search request in generation runs as its beams, one row each, in beam
        order (its prompt ran once, as the request itself)."""
        gen = output.generation_requests
        if any(r.beam is not None and len(r.beam.requests) > 1 for r in gen):
            output.generation_requests = [
                b for r in gen for b in (r.beam.requests if r.beam is not None and len(r.beam.requests) > 1 else (r,))
            ]

    def materialize_tokens(self) -> None:
        """Write the steady batch's logged tokens into its requests (see `DecodeTokenLog`):
        called before anything but the steady path reads or changes the requests."""
        decode = self._decode
        if decode is not None and decode.log is not None:
            decode.log.materialize()

    def end_steady_batch(self) -> None:
        """The next step is planned the general way (a step that verifies drafts advances its
        rows by more than one token, which the steady batch's per-slot arrays cannot follow)."""
        self.materialize_tokens()
        self._decode = None

    def set_drafts(self, drafts: dict[int, list[int]]) -> None:
        """Draft tokens (by request id) that this step's generation requests verify: each such
        row runs its last token and its drafts (`jaxllm.engine.speculation`)."""
        self._drafts = drafts

    num_ranks = 1  # attention-DP ranks (`jaxllm.engine.ranked_planner` has several)

    def rank_parts(self, output: SchedulerOutput) -> list[tuple[SchedulerOutput, KVCacheManager]]:
        """`output` with the KV block manager, as the one rank's part (see `AttentionDpPlanner`)."""
        return [(output, self.kv_cache_manager)]

    def build(self, output: SchedulerOutput, in_flight: Optional[list[TokenEntry]] = None) -> StepPlan:
        """The plan of a scheduled step (reads requests, changes none). `in_flight`: the
        entries of the previous step, whose tokens are still placeholders."""
        placement = output.kv_placement
        kv = self.kv_cache_manager
        if (
            not self._drafts
            and placement is not None
            and placement.decode is not None
            and not output.context_requests
            and kv.placement_is_current(placement)
        ):
            return self._build_decode(output, placement.decode, in_flight)
        self.materialize_tokens()
        gen = output.generation_requests
        num_gen = len(gen)
        num_tokens = sum(r.context_chunk_size for r in output.context_requests) + num_gen
        draft_lens, draft_tokens = None, None
        if self._drafts:
            drafts = [self._drafts.get(r.request_id, ()) for r in gen]
            draft_lens = np.array([len(d) for d in drafts], np.int32).reshape(num_gen)
            draft_tokens = np.fromiter((t for d in drafts for t in d), np.int32)
            num_tokens += int(draft_lens.sum())
        speculating = draft_tokens is not None and draft_tokens.size > 0
        if speculating and not output.context_requests:
            bucket, num_rows = self.spec_step_shape(num_tokens, num_gen)
        else:
            context_logits = any(
                r.logits_record is not None and r.sampling_params.wants_context_logits for r in output.context_requests
            )
            bucket, num_rows = self._step_shape(
                num_tokens, None if output.context_requests else num_gen, context_logits=context_logits
            )
        last_tokens = np.array([r.output_token_ids[-1] for r in gen], np.int32).reshape(num_gen)
        batch = build_step_batch(
            output,
            self.kv_cache_manager,
            token_bucket=bucket,
            max_batch_size=num_rows,
            max_blocks_per_seq=self.max_blocks_per_seq,
            generation_tokens=last_tokens,
            draft_lens=draft_lens,
            draft_tokens=draft_tokens,
        )
        if self.lora_slots is not None:
            batch = replace(batch, lora_slots=self._lora_token_slots(output, batch, self.lora_slots))
        feed_index = np.full((bucket,), -1, np.int32)
        num_ctx_tokens = num_tokens - num_gen - (0 if draft_tokens is None else draft_tokens.size)
        in_flight_rows = last_tokens == PLACEHOLDER_TOKEN
        if in_flight_rows.any():
            if speculating:
                raise ValueError("a speculative step needs every generation request's last token on the host")
            # The previous step's row of each such request (set by `commit`).
            if not in_flight:
                raise ValueError("a generation request waits for a token of a step that is not in flight")
            feed = np.array([r.feed_row for r in gen], np.int32).reshape(num_gen)
            feed_index[num_ctx_tokens:num_tokens] = np.where(in_flight_rows, feed, -1)
        rows = output.all_requests()
        slots = (
            placement.rows
            if kv.placement_is_current(placement) and len(placement.rows) == len(rows)
            else kv.get_table_rows(rows)
        )
        sampler_rows = self.sampler_rows(len(rows), num_rows)
        sampling = self.sampling_slots.build(
            rows, slots, sampler_rows, self.max_seq_len, lambda: self._build_sampling(rows, sampler_rows)
        )
        greedy_only = self.sampling_slots.last_build_plain and not sampling.any_random
        return StepPlan(batch, sampling, feed_index, num_tokens, num_ctx_tokens, greedy_only=greedy_only)

    def _lora_token_slots(self, output: SchedulerOutput, batch: StepBatch, lora_slots: LoraSlots) -> np.ndarray:
        """int32[T]: each token's adapter slot (-1: none, and for padding)."""
        rows = output.all_requests()
        slots = np.full(batch.token_ids.shape[0], NO_SLOT, np.int32)
        if any(r.lora_adapter is not None for r in rows):
            per_seq = np.array([lora_slots.slot_of(r) for r in rows], np.int32)
            counts = np.diff(batch.cu_q_lens[: len(rows) + 1])
            slots[: int(counts.sum())] = np.repeat(per_seq, counts)
        return slots

    def build_step(self, output: SchedulerOutput, in_flight: Optional[list[TokenEntry]] = None) -> BuiltStep:
        """`build`, leaving out the requests that make it fail (`build_isolating_failures`)."""
        return build_isolating_failures(self, output, in_flight)

    def spec_step_shape(self, num_tokens: int, num_rows: int) -> tuple[int, int]:
        """(tokens, rows) of a generation-only speculative step of `num_tokens` tokens in
        `num_rows` rows: the decode bucket of n' rows with n' * `spec_tokens_per_row` tokens
        when there is one that holds them, else a token bucket of max_batch_size rows."""
        options, per_row = self._options, self.spec_tokens_per_row
        sizes = self.decode_batch_sizes
        if per_row and sizes and options.decode_buckets and not options.beam_search:
            choose = options.choose_decode_rows
            rows = choose(num_rows) if choose is not None else choose_decode_rows(num_rows, sizes)
            if rows is not None and num_tokens <= rows * per_row <= self.max_num_tokens:
                return rows * per_row, rows
        return self._step_shape(num_tokens, None)

    def step_shape(self, num_tokens: int, decode_rows: Optional[int]) -> tuple[int, int]:
        """(tokens, rows) of a step of `num_tokens` tokens (`decode_rows`: generation-only, that
        many rows) without drafts, under the options of the step being planned."""
        return self._step_shape(num_tokens, decode_rows)

    def empty_step(
        self, bucket: int, rows: Optional[int] = None, tokens: Optional[int] = None
    ) -> tuple[StepBatch, np.ndarray]:
        """An all-padding step of `bucket` tokens and its feed index (for compiling ahead of
        traffic); `rows`: of the decode bucket of that many rows (and tokens, or `tokens`) instead."""
        batch = build_step_batch(
            SchedulerOutput([], [], []),
            self.kv_cache_manager,
            token_bucket=bucket if rows is None else (tokens or rows),
            max_batch_size=self.max_batch_size if rows is None else rows,
            max_blocks_per_seq=self.max_blocks_per_seq,
        )
        size = batch.token_ids.shape[0]
        return replace(batch, lora_slots=self.empty_lora_slots(size)), np.full((size,), -1, np.int32)

    def empty_lora_slots(self, bucket: int) -> Optional[np.ndarray]:
        """The `lora_slots` of an empty batch of `bucket` tokens (None without LoRA)."""
        return None if self.lora_slots is None else np.full(bucket, NO_SLOT, np.int32)

    def _step_shape(
        self, num_tokens: int, decode_rows: Optional[int], *, context_logits: bool = False
    ) -> tuple[int, int]:
        """(tokens, rows) of a step's buffers: a decode-only step of `decode_rows` rows runs in
        the decode bucket chosen for it, if any, any other in a token bucket of max_batch_size
        rows (`context_logits`: a request asks for its prompt's logits in this step)."""
        options, rows = self._options, None
        if decode_rows is not None and self.decode_batch_sizes and options.decode_buckets and not options.beam_search:
            choose = options.choose_decode_rows
            sizes = self.decode_batch_sizes
            rows = choose(decode_rows) if choose is not None else choose_decode_rows(decode_rows, sizes)
        if rows is None and context_logits and options.choose_context_bucket is not None:
            return options.choose_context_bucket(num_tokens), self.max_batch_size
        return (self._bucket(num_tokens), self.max_batch_size) if rows is None else (rows, rows)

    def _bucket(self, num_tokens: int) -> int:
        return (
            choose_token_bucket(num_tokens, self.max_num_tokens, self.min_token_bucket)
            if self._options.choose_bucket is None
            else self._options.choose_bucket(num_tokens)
        )

    def _build_decode(
        self, output: SchedulerOutput, decode: DecodeRows, in_flight: Optional[list[TokenEntry]]
    ) -> StepPlan:
        """`build` of a steady decode step, from the per-slot arrays `schedule` prepared."""
        gen = output.generation_requests
        n = len(gen)
        bucket, num_rows = self._step_shape(n, n)
        feed_index = None  # all -1
        if in_flight is not None and in_flight is decode.entries:
            # The previous step was committed from these rows and is still in flight: every
            # request's last token is its placeholder, sampled in the same row.
            last_tokens = np.full(n, PLACEHOLDER_TOKEN, np.int32)
            feed_index = np.full((bucket,), -1, np.int32)
            feed_index[:n] = np.arange(n, dtype=np.int32)
        elif decode.log is not None and decode.log.live and decode.log.count:
            # Nothing in flight (no overlap): each row's last token is the log's newest step.
            last_tokens = decode.log.last_tokens()
        else:
            self.materialize_tokens()
            last_tokens = np.fromiter(map(_last, map(_output_token_ids, gen)), np.int32, n)
            in_flight_rows = last_tokens == PLACEHOLDER_TOKEN
            if in_flight_rows.any():
                if not in_flight:
                    raise ValueError("a generation request waits for a token of a step that is not in flight")
                feed = np.fromiter(map(_feed_row, gen), np.int32, n)
                feed_index = np.full((bucket,), -1, np.int32)
                feed_index[:n] = np.where(in_flight_rows, feed, -1)
        packed: Optional[np.ndarray]
        batch, feed_index, packed = build_decode_batch(
            self.kv_cache_manager,
            decode.rows,
            decode.num_tokens,
            last_tokens,
            gen,
            token_bucket=bucket,
            max_batch_size=num_rows,
            max_blocks_per_seq=self.max_blocks_per_seq,
            feed_index=feed_index,
        )
        if self.lora_slots is not None:
            batch = replace(batch, lora_slots=self._lora_token_slots(output, batch, self.lora_slots))
            packed = None  # the adapter slots are an input of their own
        slots = self.sampling_slots
        plain = slots.all_plain(decode.rows)
        sampler_rows = self.sampler_rows(n, num_rows)
        if plain:  # the rows were filled by the step that recorded `decode`
            # The index of the token sampled now: the output length before this step's commit.
            sampling = slots.gather(decode.rows, decode.num_tokens - decode.orig_prompt_len, sampler_rows)
        else:
            self.materialize_tokens()
            sampling = self._build_sampling(gen, sampler_rows)
        return StepPlan(
            batch, sampling, feed_index, n, 0, packed_forward=packed, greedy_only=plain and not sampling.any_random
        )

    def sampler_rows(self, num_requests: int, num_rows: int) -> int:
        """The rows of the sampling tensors of a step of `num_requests` requests in `num_rows`
        rows: in a token bucket, the smallest of `sampler_row_sizes` holding the requests (the
        runner samples that many of the forward's first rows; the others are padding), so a
        sampler's cost follows the requests, not max_batch_size; else `num_rows`. Not while
        rows ask for logits outputs or post-processors (their programs take every row), beams
        or drafts."""
        options = self._options
        if (
            not self.sampler_row_sizes
            or num_rows != self.max_batch_size
            or self._drafts
            or not options.decode_buckets
            or options.beam_search
        ):
            return num_rows
        return choose_decode_rows(num_requests, self.sampler_row_sizes) or num_rows

    def _build_sampling(self, rows: list[LlmRequest], num_rows: int) -> SamplingTensors:
        """Sampling tensors of `num_rows` rows from every request's parameters (any setting)."""
        params = [r.sampling_params for r in rows]
        needs_history = any(p.needs_history for p in params)
        sampling = SamplingTensors.build(
            params,
            [len(r.output_token_ids) for r in rows],
            [(r.prompt_token_ids[: r.orig_prompt_len], r.output_token_ids) for r in rows] if needs_history else None,
            [r.end_ids for r in rows],
            num_rows,
            self.max_seq_len,
            seeds=[r.seed for r in rows],
        )
        if needs_history and self.guided_matchers is not None:
            bitmask = self.guided_matchers.fill(rows, num_rows)
            if bitmask is not None:
                sampling = sampling.with_token_bitmask(bitmask)
        return sampling

    def commit(self, output: SchedulerOutput) -> list[TokenEntry] | DecodeEntries:
        """Advance the scheduled requests as if the step ran: prompt chunks move on, and each
        request that gets a token (generation, or a finished prompt) carries a placeholder.
        Returns the step's token entries (`DecodeEntries` for a steady decode step)."""
        self._drafts = {}
        placement = output.kv_placement
        decode = None if placement is None else placement.decode
        if decode is not None and not output.context_requests:
            # A steady decode step: every request is generating and sits in the row it had in
            # the step that started the batch, so its `feed_row` is already that row.
            gen = output.generation_requests
            log = decode.log
            if log is None and self._options.defer_tokens:
                log = decode.log = DecodeTokenLog(gen, self.token_log_capacity)
            if log is not None and log.live:
                log.commit()  # the lists get this step's token once the log is flushed
            else:
                log = None
                for out in map(_output_token_ids, gen):
                    out.append(PLACEHOLDER_TOKEN)  # a plain loop: cheaper than map(list.append, ...)
            entries = DecodeEntries(gen, decode.num_tokens - decode.orig_prompt_len, log)
            decode.entries = entries
            return entries
        self.materialize_tokens()
        return self.advance(output)

    @staticmethod
    def advance(output: SchedulerOutput) -> list[TokenEntry]:
        """`commit` of a general step: every scheduled request moves on by itself."""
        entries: list[TokenEntry] = []
        append = entries.append
        for row, request in enumerate(output.all_requests()):
            state = request.state
            if state is _GENERATION_IN_PROGRESS or state is _GENERATION_TO_COMPLETE:
                out = request.output_token_ids  # add_new_token in this state is an append
                append((request, row, len(out)))
                out.append(PLACEHOLDER_TOKEN)
                request.feed_row = row
                continue
            produces_token = request.is_last_context_chunk
            if request.is_context_phase:
                request.move_to_next_context_chunk()
            if produces_token:
                append((request, row, len(request.output_token_ids)))
                request.add_new_token(PLACEHOLDER_TOKEN)
                request.feed_row = row
        return entries

    def plan(self, candidates: list[LlmRequest], in_flight: Optional[list[TokenEntry]] = None) -> Optional[PlannedStep]:
        """schedule + build + commit in one call (no failure isolation)."""
        output = self.schedule(candidates)
        if output is None:
            return None
        plan = self.build(output, in_flight)
        return PlannedStep(plan, output, self.commit(output))
