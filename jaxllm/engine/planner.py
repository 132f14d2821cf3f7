"""The host half of a step: scheduler + KV block manager + batch building -> a `StepPlan`.

A `StepPlan` holds only numpy arrays and scalars: everything the device side needs to run
one step, and nothing that refers to a request object. It is what a leader process would
send to its followers in a multi-host run; `ModelRunner.execute(plan)` runs it on the mesh.
The planner never touches a device (it imports no backend and allocates no device memory),
so it can be run, timed and tested alone.

One step is planned in three calls, so the engine can isolate failures between them:
`schedule` (scheduling decision + KV blocks), `build` (the plan; reads requests, changes
none) and `commit` (moves the scheduled requests forward: prompt chunks advance, requests
that will get a token carry a placeholder until the runner's output is read back).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from jaxllm.batch_builder import build_step_batch, choose_token_bucket, token_buckets
from jaxllm.kv_cache import KVCacheManager
from jaxllm.request import LlmRequest
from jaxllm.sampling import SamplingTensors
from jaxllm.scheduler import SchedulerOutput
from jaxllm.step_batch import StepBatch

PLACEHOLDER_TOKEN = -1
"""An output token sampled by a step still in flight (its value is on the device)."""

# A request that gets a token from a step: (request, row in the step, index in output_token_ids).
TokenEntry = tuple[LlmRequest, int, int]


@dataclass
class StepPlan:
    """The device inputs of one step, as plain host arrays.

    `feed_index[t] >= 0` means token `t` is the token sampled in row `feed_index[t]` of the
    previous step (not yet known on the host); the runner keeps that step's output.
    """

    batch: StepBatch  # numpy arrays of one token bucket
    sampling: SamplingTensors  # numpy arrays and the sampler's static switches
    feed_index: np.ndarray  # int32[T]
    num_tokens: int  # tokens before padding
    num_context_tokens: int


@dataclass
class PlannedStep:
    """A plan with the host bookkeeping the engine needs once its tokens are back."""

    plan: StepPlan
    output: SchedulerOutput
    entries: list[TokenEntry] = field(default_factory=list)


class Planner:
    def __init__(self, *, scheduler, kv_cache_manager: KVCacheManager, max_batch_size: int, max_num_tokens: int,
                 min_token_bucket: int, max_blocks_per_seq: int, max_seq_len: int) -> None:
        self.scheduler = scheduler
        self.kv_cache_manager = kv_cache_manager
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.min_token_bucket = min_token_bucket
        self.max_blocks_per_seq = max_blocks_per_seq
        self.max_seq_len = max_seq_len

    def token_buckets(self) -> list[int]:
        """Every token-buffer size a plan can have (one compiled model forward each)."""
        return token_buckets(self.max_num_tokens, self.min_token_bucket)

    def schedule(self, candidates: list[LlmRequest]) -> Optional[SchedulerOutput]:
        """Choose the step's requests and give them KV blocks; None when nothing runs."""
        output = self.scheduler.schedule_request(candidates, set())
        for paused in output.paused_requests:
            self.kv_cache_manager.free_resources(paused)
        if output.is_empty:
            return None
        self.kv_cache_manager.prepare_resources(output)
        return output

    def build(self, output: SchedulerOutput, in_flight: Optional[list[TokenEntry]] = None) -> StepPlan:
        """The plan of a scheduled step (reads requests, changes none). `in_flight`: the
        entries of the previous step, whose tokens are still placeholders."""
        num_gen = len(output.generation_requests)
        num_tokens = sum(r.context_chunk_size for r in output.context_requests) + num_gen
        bucket = choose_token_bucket(num_tokens, self.max_num_tokens, self.min_token_bucket)
        batch = build_step_batch(output, self.kv_cache_manager, token_bucket=bucket,
                                 max_batch_size=self.max_batch_size, max_blocks_per_seq=self.max_blocks_per_seq)
        feed_index = np.full((bucket,), -1, np.int32)
        num_ctx_tokens = num_tokens - num_gen
        prev_rows = {id(r): row for r, row, _ in in_flight or ()}
        for i, request in enumerate(output.generation_requests):
            if request.output_token_ids[-1] == PLACEHOLDER_TOKEN:
                feed_index[num_ctx_tokens + i] = prev_rows[id(request)]
        rows = output.all_requests()
        params = [r.sampling_params for r in rows]
        needs_history = any(p.needs_history for p in params)
        sampling = SamplingTensors.build(
            params, [len(r.output_token_ids) for r in rows],
            [(r.prompt_token_ids[:r.orig_prompt_len], r.output_token_ids) for r in rows] if needs_history else None,
            [r.end_ids for r in rows], self.max_batch_size, self.max_seq_len, seeds=[r.seed for r in rows])
        return StepPlan(batch, sampling, feed_index, num_tokens, num_ctx_tokens)

    @staticmethod
    def commit(output: SchedulerOutput) -> list[TokenEntry]:
        """Advance the scheduled requests as if the step ran: prompt chunks move on, and each
        request that gets a token (generation, or a finished prompt) carries a placeholder."""
        entries: list[TokenEntry] = []
        for row, request in enumerate(output.all_requests()):
            produces_token = request.is_generation_phase or request.is_last_context_chunk
            if request.is_context_phase:
                request.move_to_next_context_chunk()
            if produces_token:
                entries.append((request, row, len(request.output_token_ids)))
                request.add_new_token(PLACEHOLDER_TOKEN)
        return entries

    def plan(self, candidates: list[LlmRequest], in_flight: Optional[list[TokenEntry]] = None
             ) -> Optional[PlannedStep]:
        """schedule + build + commit in one call (no failure isolation)."""
        output = self.schedule(candidates)
        if output is None:
            return None
        plan = self.build(output, in_flight)
        return PlannedStep(plan, output, self.commit(output))
