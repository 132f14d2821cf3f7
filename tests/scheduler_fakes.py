"""A model-free stand-in for the engine loop, shared by the scheduler and KV cache tests.

`FakeExecutor.step()` does what the engine does each step: schedule, allocate KV blocks,
build the StepBatch, "run" it, and apply the sampled tokens through the request methods.
The "device" is a flat array of KV slots: each step writes every token's id into its slot
(via slot_mapping) and then reads back each scheduled sequence through its block table.
Reading back the exact token sequence proves the block tables, slot mapping, prefix reuse
and eviction are consistent; sampled tokens are a pure function of (request, index) so a
paused-and-recomputed request produces the same output as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from jaxllm.batch_builder import build_step_batch, choose_token_bucket
from jaxllm.engine.planner import Planner
from jaxllm.kv_cache import KVCacheManager
from jaxllm.llm_request import LlmRequest
from jaxllm.scheduler import RequestScheduler, SchedulerOutput


def fake_token(request: LlmRequest) -> int:
    """The token the fake model samples next for `request` (depends only on position)."""
    return (request.request_id * 7919 + len(request.output_token_ids) * 104729 + 17) % 32000


@dataclass
class StepRecord:
    step: int
    context: list[tuple[int, int, int]]  # (request_id, position before, chunk)
    generation: list[int]
    paused: list[int]
    finished: list[int]

    @property
    def context_ids(self) -> list[int]:
        return [rid for rid, _, _ in self.context]


@dataclass
class FakeExecutor:
    scheduler: RequestScheduler
    kv: KVCacheManager
    max_batch_size: int
    max_num_tokens: int
    # request_id -> number of output tokens after which the request stops ("stop token")
    stop_after: dict[int, int] = field(default_factory=dict)
    check_kv_contents: bool = True
    check_invariants: bool = True
    active: list[LlmRequest] = field(default_factory=list)
    finished: list[LlmRequest] = field(default_factory=list)
    history: list[StepRecord] = field(default_factory=list)
    inflight_request_ids: set[int] = field(default_factory=set)
    on_batch: Optional[Callable] = None

    def __post_init__(self) -> None:
        self.device_kv = np.full(self.kv.num_kv_slots + 1, -1, dtype=np.int64)

    def add(self, *requests: LlmRequest) -> None:
        self.active.extend(requests)

    def abort(self, request: LlmRequest) -> None:
        request.finish("cancelled")
        self.kv.free_resources(request)
        self.active.remove(request)
        self.finished.append(request)

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule_request(self.active, self.inflight_request_ids)
        record = StepRecord(
            step=len(self.history),
            context=[(r.request_id, r.context_current_position, r.context_chunk_size) for r in out.context_requests],
            generation=[r.request_id for r in out.generation_requests],
            paused=[r.request_id for r in out.paused_requests],
            finished=[],
        )
        self.kv.prepare_resources(out)
        if out.batch_size:
            bucket = choose_token_bucket(out.num_tokens, self.max_num_tokens)
            batch = build_step_batch(
                out,
                self.kv,
                token_bucket=bucket,
                max_batch_size=self.max_batch_size,
                max_blocks_per_seq=self.kv.max_blocks_per_seq,
            )
            if self.on_batch is not None:
                self.on_batch(out, batch)
            if self.check_kv_contents:
                self._run_fake_device(out, batch)
            sampled = [fake_token(r) for r in out.all_requests()]
            for req, row, index in Planner.advance(out):  # the engine's own request update
                req.output_token_ids[index] = sampled[row]
                stop = self.stop_after.get(req.request_id)
                if stop is not None and len(req.output_token_ids) >= stop:
                    req.finish("stop")
                elif req.reached_max_new_tokens:
                    req.finish("length")
                if req.is_finished:
                    self.kv.free_resources(req)
                    record.finished.append(req.request_id)
        still = []
        for req in self.active:
            (self.finished if req.is_finished else still).append(req)
        self.active = still
        if self.check_invariants:
            self.kv.check_invariants()
        self.history.append(record)
        return out

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.active:
                return
            self.step()
        raise AssertionError(f"requests still active after {max_steps} steps: {[r.request_id for r in self.active]}")

    # -------------------------------------------------------------- checks
    def _run_fake_device(self, out: SchedulerOutput, batch) -> None:
        total = int(batch.cu_q_lens[int(batch.num_seqs[0])])
        slots = batch.slot_mapping[:total]
        if (slots >= self.kv.num_kv_slots).any() or (batch.slot_mapping[total:] != self.kv.num_kv_slots).any():
            raise AssertionError("slot mapping points outside the pool / padding not dropped")
        if len(np.unique(slots)) != total:
            raise AssertionError("two tokens of one step write the same KV slot")
        self.device_kv[slots] = batch.token_ids[:total]
        tpb = self.kv.tokens_per_block
        for s, req in enumerate(out.all_requests()):
            lo, hi = int(batch.cu_q_lens[s]), int(batch.cu_q_lens[s + 1])
            kv_len = int(batch.kv_lens[s])
            expected = np.asarray(req.get_tokens(0, kv_len))
            if req.is_context_phase:
                start = req.context_current_position
            else:
                start = req.num_tokens - 1
            if not np.array_equal(batch.token_ids[lo:hi], expected[start:kv_len]):
                raise AssertionError(f"request {req.request_id}: wrong input tokens")
            if not np.array_equal(batch.positions[lo:hi], np.arange(start, kv_len)):
                raise AssertionError(f"request {req.request_id}: wrong positions")
            if int(batch.logits_indices[s]) != hi - 1:
                raise AssertionError(f"request {req.request_id}: wrong logits index")
            pos = np.arange(kv_len)
            read = self.device_kv[batch.block_tables[s][pos // tpb] * tpb + pos % tpb]
            if not np.array_equal(read, expected):
                raise AssertionError(
                    f"request {req.request_id}: KV cache reads back {read.tolist()} instead of {expected.tolist()}"
                )


def make_requests(
    prompt_lens: list[int],
    max_new_tokens: int | list[int],
    *,
    start_id: int = 1,
    token_base: Optional[int] = None,
    priorities: Optional[list[float]] = None,
) -> list[LlmRequest]:
    """Requests with distinct prompts (unless token_base makes them share tokens) and
    strictly increasing arrival times in list order."""
    reqs = []
    for i, plen in enumerate(prompt_lens):
        rid = start_id + i
        base = rid * 1000 if token_base is None else token_base
        mnt = max_new_tokens[i] if isinstance(max_new_tokens, list) else max_new_tokens
        reqs.append(
            LlmRequest(
                rid,
                list(range(base, base + plen)),
                mnt,
                priority=0.0 if priorities is None else priorities[i],
                arrival_time=float(i),
            )
        )
    return reqs
