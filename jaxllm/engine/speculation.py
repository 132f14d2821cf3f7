"""Speculative decoding inside the in-flight batch: drafts in, verified tokens out.

One step of a speculating engine (built with `EngineConfig.speculative_config`):

1. `propose` (after scheduling): each eligible generation request gets up to
   `max_draft_len` draft tokens from the proposer (n-gram: `jaxllm.spec_decode`; MTP, a draft
   model, EAGLE-3: a `StepDrafter` run over the step just read back), its KV sequence
   grows to hold them (`KVCacheManager.grow_for_drafts`), and the planner packs its row as its
   last token followed by the drafts (`Planner.set_drafts`): 1 + k query tokens, like a
   context chunk, in the same fixed token buckets.
2. `prepare` adds to the plan the packed indices of those tokens (`context_index`): the
   forward variant that returns their logits runs (one per token bucket, compiled at
   warm-up, with a fixed number of verification entries per bucket: `verify_rows`).
3. `launch` runs the verification program (`jaxllm.sampling.rejection.verify_drafts`) over
   those logits with each entry's sampling settings at the output index it produces.
4. `read_back` (after the step's other rows are read back) writes each speculating
   request's accepted drafts plus the target's next token, one token at a time through the
   same stop checks as without speculation (end ids, stop token ids, max_tokens, min_tokens),
   with their logprobs, and rolls the KV sequence back to the tokens kept
   (`KVCacheManager.roll_back`): rejected drafts' KV is overwritten later, and blocks taken
   only for them go back to the pool.

Which requests draft, and how many tokens, adapts per step: a request drafts only the tokens
whose estimated acceptance (its own running acceptance rate, to the power of the draft
position) is high enough, and the step speculates only when its expected tokens per second,
from the measured time of steps of each shape, beats the step without drafts (TensorRT-LLM's
and vLLM's adaptive draft lengths do the same in spirit); otherwise it runs as a plain step.

Speculation runs without the overlap scheduler and without the steady-decode fast path (a
draft needs the previous token on the host), which the engine turns off when a speculative
config is set. Requests that need their token history on the device (penalties, bad words,
grammars, host logits processors), beam search and logits outputs do not draft. With
attention DP each rank drafts within its own token budget and block pool (`Planner.rank_parts`;
a drafter from its own pool per rank, `jaxllm.models.parallel.attention_dp_drafting`) and its
verification entries come from its own packed tokens (`jaxllm.engine.verify_inputs`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Container
from typing import Any, Optional

import jax
import numpy as np

from jaxllm.engine.device_reads import all_to_host
from jaxllm.engine.draft_model_drafter import DraftModelDrafter
from jaxllm.engine.draft_policy import DraftPolicy
from jaxllm.engine.eagle3_drafter import Eagle3Drafter
from jaxllm.engine.mtp_drafter import MTPDrafter
from jaxllm.engine.planner import Planner, StepPlan, TokenEntry
from jaxllm.engine.speculation_programs import relaxed_options
from jaxllm.engine.speculation_warmup import warm_up_speculation
from jaxllm.engine.step_drafter import StepDrafter
from jaxllm.engine.step_updates import RequestUpdate
from jaxllm.engine.thinking_phase import ThinkingPhases, thinking_tokens
from jaxllm.engine.verified_tokens import SpeculativeStep, apply_verified
from jaxllm.engine.verify_inputs import VerifyInputs, verification_inputs
from jaxllm.llm_request import LlmRequest, LlmRequestState
from jaxllm.sampling import SamplingTensors
from jaxllm.sampling.rejection import AcceptanceRule, VerifyOutput, exact_acceptance, verify_drafts
from jaxllm.scheduler import SchedulerOutput
from jaxllm.spec_decode import NGramProposer
from jaxllm.speculative_config import (
    DraftTargetDecodingConfig,
    EagleDecodingConfig,
    MTPDecodingConfig,
    NGramDecodingConfig,
    SpeculativeConfig,
)

logger = logging.getLogger(__name__)

_GENERATION_IN_PROGRESS = LlmRequestState.GENERATION_IN_PROGRESS
_COMPLETE = LlmRequestState.GENERATION_COMPLETE


def _penalties_only(params: Any) -> bool:
    """Whether the token history `params` need is only their penalties' (which verification
    applies with each entry's drafts in the history), not bad-word sequences, a grammar or a
    host logits processor."""
    return not params.bad and params.logits_processor is None and params.guided_decoding is None


def build_speculation(config: Any, *, planner: Planner, runner: Any, tokenizer: Any = None) -> Optional[Speculation]:
    """The engine's `Speculation` for `config.speculative_config` (an `EngineConfig`), None
    without one (`capabilities.check_engine_speculation` checked the combination before the engine was built).
    `tokenizer`: the model's (relaxed MTP acceptance looks up its thinking tokens)."""
    spec_config = config.speculative_config
    if spec_config is None:
        return None
    thinking = None
    if isinstance(spec_config, MTPDecodingConfig) and spec_config.use_relaxed_acceptance_for_thinking:
        thinking = ThinkingPhases(thinking_tokens(tokenizer))
    return Speculation(
        spec_config,
        planner=planner,
        max_batch_size=config.max_batch_size,
        max_num_tokens=config.max_num_tokens,
        min_token_bucket=config.min_token_bucket,
        drafter=step_drafter_for(  # the blocks of one rank's pool (its own pool per rank under attention DP)
            spec_config,
            runner,
            planner.kv_cache_manager.num_blocks // planner.num_ranks,
            planner.kv_cache_manager.tokens_per_block,
        ),
        thinking=thinking,
    )


def step_drafter_for(config: SpeculativeConfig, runner: Any, blocks: int, tpb: int) -> Optional[StepDrafter]:
    """The drafter run after each step for `config` (MTP layers, a draft model, EAGLE-3), else
    None; its pool has `blocks` blocks of `tpb` tokens (the target's)."""
    if isinstance(config, MTPDecodingConfig):
        return MTPDrafter(config, runner, blocks, tpb)
    if isinstance(config, DraftTargetDecodingConfig):
        return DraftModelDrafter(config, runner, blocks, tpb)
    if isinstance(config, EagleDecodingConfig):
        return Eagle3Drafter(config, runner, blocks, tpb)
    return None


class Speculation:
    """Proposes, verifies and applies drafts for one engine (engine thread only)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        *,
        planner: Planner,
        max_batch_size: int,
        max_num_tokens: int,
        min_token_bucket: int,
        drafter: Optional[StepDrafter] = None,
        thinking: Optional[ThinkingPhases] = None,
    ) -> None:
        """`drafter`: the MTP layers', the draft model's or the EAGLE-3 head's drafter
        (`step_drafter_for`), run over a step after its read-back when the next step drafts;
        `thinking`: the requests' thinking spans, where greedy rows accept drafts by the
        relaxed rule (`MTPDecodingConfig.use_relaxed_acceptance_for_thinking`), else None."""
        self.config = config
        self.max_draft_len = config.max_draft_len
        self.drafter = drafter
        self.proposer: Any
        if isinstance(config, NGramDecodingConfig):
            self.proposer = NGramProposer(config)
        elif drafter is not None:
            self.proposer = drafter
        else:
            raise ValueError(f"{type(config).__name__} is not supported yet")
        self.planner = planner
        planner.spec_tokens_per_row = 1 + config.max_draft_len
        self.kv = planner.kv_cache_manager
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.min_token_bucket = min_token_bucket
        # How a sampled entry accepts its draft (a parameter so a test can swap in a wrong rule).
        self.acceptance_rule: AcceptanceRule = exact_acceptance
        self.thinking = thinking
        self._relaxed = relaxed_options(config) if thinking is not None else {}
        self._jits: dict[Callable, Any] = {}
        # Who runs the verification program when not this object (a multi-host leader's
        # mirrored programs, `use_programs`: every process verifies).
        self._verifier_elsewhere: Optional[Callable[..., VerifyOutput]] = None
        # Adaptive drafting (which rows draft how many tokens, and whether a step drafts).
        self.policy = DraftPolicy(planner, config.max_draft_len)
        self.policy.shared_prior = drafter is not None
        # Totals (TensorRT-LLM's specDecodingStats names, summed over the run).
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_speculative_steps = 0
        self.num_verified_rows = 0
        self.num_accepted_per_pos = [0] * config.max_draft_len  # rows whose draft j was accepted
        self._draft_seconds = 0.0  # host time proposing the step being planned (drafter included)
        self._drafter_seconds = 0.0  # of which the drafter's program
        self._prompt_tokens = 0  # output tokens the prompts the last dispatched step started may serve
        self._step_stats: Optional[dict] = None  # its specDecodingStats (draftOverhead: `observe`)
        # The step being planned: its drafts, its verification inputs once planned (`prepare`)
        # and its verification outputs once dispatched (`launch`).
        self._drafts: dict[int, list[int]] = {}
        self._verify: Optional[VerifyInputs] = None
        self._verified: Optional[VerifyOutput] = None
        self._spec_entries: Optional[list[TokenEntry]] = None

    # ------------------------------------------------------------------ the engine's step
    def begin_step(self, output: SchedulerOutput, active: Container[int], may_draft: bool) -> None:
        """A step was scheduled: its drafts (`propose`, when `may_draft`: nothing in flight,
        no logits outputs or beams) go to the planner."""
        self._verify, self._verified, self._spec_entries = None, None, None
        started = time.perf_counter()
        self._drafter_seconds = 0.0
        if may_draft:  # the proposers read each request's tokens, which a steady batch may log
            self.planner.materialize_tokens()
        self._drafts = self.propose(output, active) if may_draft else {}
        self._draft_seconds = time.perf_counter() - started
        if may_draft:
            self.planner.set_drafts(self._drafts)
        if self._drafts:  # its rows gain 1 + accepted tokens each: no longer a steady batch
            self.planner.end_steady_batch()

    def drop_drafts(self) -> None:
        """No plan could be built: the planner forgets the step's drafts."""
        if self._drafts:
            self.planner.set_drafts({})
            self._drafts = {}

    def verification_plan(self, plan: StepPlan, output: SchedulerOutput) -> StepPlan:
        """The step's plan, with its verification tokens' indices when it drafts (`prepare`)."""
        if self._drafts:
            plan, self._verify = self.prepare(plan, output, self._drafts)
        self.planned(plan)
        return plan

    def after_dispatch(self, plan: StepPlan, output: SchedulerOutput, context_logits: Any) -> None:
        """The step was dispatched: the drafter notes it and the verification program runs."""
        self.dispatched(plan, output)
        if self._verify is not None:
            self._verified = self.launch(context_logits, *self._verify[3:])

    def take_entries(self, entries: Any) -> Any:
        """The step's entries less its speculating rows' (kept for `speculative_step`)."""
        if self._verify is None:
            return entries
        entries, self._spec_entries = self.split_entries(entries, self._verify[0])
        return entries

    def speculative_step(self, wants_logprobs: bool, stats: dict) -> Optional[SpeculativeStep]:
        """What the dispatched step's read-back applies for its speculating rows (None: none)."""
        verify, verified, entries = self._verify, self._verified, self._spec_entries
        self._verify, self._verified, self._spec_entries = None, None, None
        # TensorRT-LLM's specDecodingStats; the counts are the read-back's, iterLatencyMS the
        # drafting time, draftOverhead its share of the engine's step (`observe`).
        self._step_stats = stats["specDecodingStats"] = {
            "numDraftTokens": 0,
            "numAcceptedTokens": 0,
            "numRequestsWithDraftTokens": 0,
            "acceptanceLength": 1.0,
            "iterLatencyMS": self._draft_seconds * 1e3,
            "draftOverhead": 0.0,
        }
        if verify is None or verified is None or entries is None:
            return None
        return SpeculativeStep(entries, verify[1], verify[2], verified, wants_logprobs, stats)

    # ------------------------------------------------------------------ shapes
    def verify_rows(self, bucket: int) -> int:
        """Verification entries of a speculative step in token bucket `bucket` (fixed per
        bucket: one compiled forward variant and verifier each)."""
        return min(bucket, self.max_batch_size * (self.max_draft_len + 1))

    def _verifier(self) -> Any:
        rule = self.acceptance_rule
        jitted = self._jits.get(rule)
        if jitted is None:
            jitted = self._jits[rule] = jax.jit(functools.partial(verify_drafts, acceptance_rule=rule, **self._relaxed))
        return jitted

    @property
    def num_compiled(self) -> int:
        """Compiled verification (and MTP drafting) programs (every shape and variant seen)."""
        drafting = self.drafter.num_compiled if self.drafter is not None else 0
        return sum(j._cache_size() for j in self._jits.values()) + drafting

    # ------------------------------------------------------------------ propose
    def _eligible_len(self, request: LlmRequest) -> int:
        """The most drafts `request` may verify this step (0: it does not draft)."""
        params = request.sampling_params
        if (
            request.state is not _GENERATION_IN_PROGRESS
            or request.beam is not None
            or request.beam_width > 1
            or (params.needs_history and not _penalties_only(params))
            or params.logits_post_processor_name is not None
            or params.return_generation_logits
            or request.logits_record is not None
        ):
            return 0
        out = len(request.output_token_ids)
        k = min(self.max_draft_len, params.max_tokens - out - 1, request.max_new_tokens - out - 1)
        if out < params.min_tokens:  # end ids are banned before min_tokens: stay on one side of it
            k = min(k, params.min_tokens - 1 - out)
        return self.policy.draft_len(request.request_id, max(k, 0))

    def propose(self, output: SchedulerOutput, active: Container[int]) -> dict[int, list[int]]:
        """Drafts of the scheduled generation requests (by request id), within the step's
        token budget; their KV sequences grow to hold them. Empty when the step runs plain.
        A drafter (MTP, draft model, EAGLE-3) runs over the step just read back only when the
        policy says this step drafts."""
        gen = output.generation_requests
        self._forget_finished(active)
        num_ctx = sum(r.context_chunk_size for r in output.context_requests)
        budget = self.max_num_tokens - num_ctx - len(gen)
        drafter = self.drafter
        if drafter is not None:
            drafting = self._drafting(output, budget, num_ctx)
            context, shape = drafter.pending_context, drafter.pending_shape
            if drafting or (context and self.policy.drafting_alive()):
                self._drafter_seconds = drafter.begin_step()
                if context:
                    self.policy.prompt_ran(self._drafter_seconds, self._prompt_tokens)
                elif shape is not None:
                    self.policy.drafter_ran(shape, self._drafter_seconds)
            else:
                drafter.skip_step()
            if not drafting:
                if gen:
                    self.policy.proposed(False)
                return {}
        if not gen:
            return {}
        drafts: dict[int, list[int]] = {}
        # Each rank (one without attention DP) has its own token budget and block pool.
        for part, kv in self.planner.rank_parts(output):
            rank_gen = part.generation_requests
            budget = self.max_num_tokens - sum(r.context_chunk_size for r in part.context_requests) - len(rank_gen)
            free_blocks = kv.num_free_blocks
            for request in rank_gen:
                if budget <= 0:
                    break
                k = min(self._eligible_len(request), budget)
                if k <= 0:
                    continue
                try:
                    draft = [int(t) for t in self.proposer.propose(request.request_id, request.all_token_ids, k)][:k]
                except Exception:  # a proposer's failure costs the drafts, nothing else
                    logger.exception("the draft proposer failed for request %s", request.request_id)
                    continue
                # Blocks the drafts need beyond the fed token's (a scheduler that allocates per
                # step may have left none to spare: then the request does not draft).
                extra = kv.blocks_for_tokens(request.num_tokens + len(draft)) - max(
                    kv.get_num_allocated_blocks(request), kv.blocks_for_tokens(request.num_tokens)
                )
                if draft and extra <= free_blocks:
                    drafts[request.request_id] = draft
                    budget -= len(draft)
                    free_blocks -= max(extra, 0)
        if drafts and self.drafter is None and not self.policy.worth_it(output, drafts, num_ctx):
            drafts = {}
        for request in gen:
            draft = drafts.get(request.request_id)
            if draft:
                self.kv.grow_for_drafts(request, request.num_tokens + len(draft))
        self.policy.proposed(bool(drafts))
        return drafts

    def _drafting(self, output: SchedulerOutput, budget: int, num_ctx: int) -> bool:
        """Whether a drafter's step drafts: always without adaptive drafting, else when some
        row would draft and drafting its expected lengths is worth it. Decided before the
        drafter runs, so a step that does not draft does not pay for it (the drafter still runs
        over a step that processed prompt tokens, so its pool holds every prompt position,
        while `DraftPolicy.drafting_alive`)."""
        if not self.policy.adaptive:
            return True
        lengths: dict[int, list[int]] = {}
        for request in output.generation_requests:
            if budget <= 0:
                break
            k = min(self._eligible_len(request), budget)
            if k > 0:
                lengths[request.request_id] = [0] * k
                budget -= k
        if not lengths:
            return False
        drafter = self.drafter
        if drafter is not None and drafter.pending_context:
            # Over a step with prompt tokens the drafter runs anyway while it is worth running
            # (its cost is a prompt run's); otherwise drafting would take a prompt run judged
            # not worth it.
            return self.policy.drafting_alive() and self.policy.worth_it(output, lengths, num_ctx)
        shape = None if drafter is None else drafter.pending_shape
        return self.policy.worth_it(output, lengths, num_ctx, drafter_shape=shape)

    def dispatched(self, plan: StepPlan, output: SchedulerOutput) -> None:
        """A step was dispatched (the MTP drafter runs over it once it is read back)."""
        if self.drafter is not None:
            ranks = [part.all_requests() for part, _ in self.planner.rank_parts(output)]
            stacked = np.ndim(plan.batch.token_ids) == 2  # attention DP: each rank's rows
            self.drafter.dispatched(plan.batch, ranks if stacked else ranks[0], plan.num_context_tokens > 0)
            # The output tokens the prompts this step starts may serve (a prompt run's charge).
            self._prompt_tokens = sum(
                max(min(r.sampling_params.max_tokens, r.max_new_tokens) - len(r.output_token_ids), 0)
                for r in output.context_requests
                if r.is_first_context_chunk
            )

    def wants_drafts(self) -> bool:
        """Whether the next step should try drafting (the engine then reads back first), or
        the drafter must run over the step in flight (it processed prompt tokens)."""
        if self.drafter is not None and self.drafter.pending_context and self.policy.drafting_alive():
            return True
        return self.policy.wants_drafts()

    def planned(self, plan: StepPlan) -> None:
        """The shape of the step just dispatched (its time is observed next)."""
        kind = "spec" if plan.context_index is not None else "plain"
        self.policy.planned(kind, int(plan.batch.token_ids.shape[-1]), int(plan.sampling.batch_size))

    def observe(self, seconds: float) -> None:
        """The wall time of the engine's step that dispatched the step last `planned`."""
        # A drafter's program is charged on its own (`DraftPolicy.drafter_ran`, `prompt_ran`).
        self.policy.observe(max(seconds - self._drafter_seconds, 0.0))
        if self._step_stats is not None and seconds > 0:
            self._step_stats["draftOverhead"] = min(1.0, self._draft_seconds / seconds)
        self._step_stats = None

    @property
    def adaptive(self) -> bool:
        """Whether drafting adapts (False: every eligible row drafts every step it can)."""
        return self.policy.adaptive

    @adaptive.setter
    def adaptive(self, value: bool) -> None:
        self.policy.adaptive = value

    def _forget_finished(self, active: Container[int]) -> None:
        self.policy.forget(active, 4 * self.max_batch_size)
        if self.thinking is not None:
            self.thinking.forget(active)
        texts = self.proposer.request_ids()
        if len(texts) > 4 * self.max_batch_size:
            for rid in [rid for rid in texts if rid not in active]:
                self.proposer.release(rid)

    # ------------------------------------------------------------------ verify
    def prepare(
        self, plan: StepPlan, output: SchedulerOutput, drafts: dict[int, list[int]]
    ) -> tuple[StepPlan, Optional[VerifyInputs]]:
        """The plan with the verification tokens' indices (`context_index`), and the inputs of
        the verification program (`jaxllm.engine.verify_inputs`)."""
        return verification_inputs(
            plan,
            self.planner.rank_parts(output),
            drafts,
            size=self.verify_rows(plan.batch.token_ids.shape[-1]),
            max_batch_size=self.max_batch_size,
            thinking=self.thinking,
        )

    def launch(
        self,
        context_logits: Any,
        tensors: SamplingTensors,
        draft_ids: np.ndarray,
        thinking: Optional[np.ndarray] = None,
    ) -> VerifyOutput:
        """Dispatch the verification program (not waited for). `thinking`: the entries inside a
        thinking span (relaxed acceptance only; None there: none)."""
        if self.thinking is None:
            thinking = None
        elif thinking is None:
            thinking = np.zeros(draft_ids.shape, np.bool_)
        if self._verifier_elsewhere is not None:
            return self._verifier_elsewhere(context_logits, tensors, draft_ids, thinking)
        return self._verifier()(context_logits, tensors, draft_ids, thinking)

    def use_programs(self, programs: Any) -> None:
        """Verify and draft through `programs` (a multi-host leader's `MirroredSpeculation`,
        whose calls every process makes); the acceptance rule is then the exact (or relaxed) one."""
        self._verifier_elsewhere = programs.verify
        if self.drafter is not None:
            self.drafter.launcher = programs.draft

    @staticmethod
    def split_entries(entries: list[TokenEntry], spec_rows: list[int]) -> tuple[list[TokenEntry], list[TokenEntry]]:
        """(the step's other entries, the speculating rows' entries in `spec_rows` order)."""
        by_row = {row: i for i, row in enumerate(spec_rows)}
        spec: list[Optional[TokenEntry]] = [None] * len(spec_rows)
        plain = []
        for entry in entries:
            i = by_row.get(entry[1])
            if i is None:
                plain.append(entry)
            else:
                spec[i] = entry
        if any(e is None for e in spec):
            raise RuntimeError("a speculating row has no token entry")
        return plain, spec  # type: ignore[return-value]

    # ------------------------------------------------------------------ read back
    def read_back(self, step: SpeculativeStep, requests: Any) -> list[RequestUpdate]:
        """Apply a speculative step's verified tokens (see module docstring); `requests`: the
        engine's `RequestTable` (finishes requests that stop)."""
        out = step.output
        wanted = (out.logprobs, out.top_ids, out.top_logprobs) if step.wants_logprobs else ()
        host = all_to_host(out.token_ids, out.accepted, *wanted)  # one blocking read
        token_ids, accepted = host[0].tolist(), host[1]
        logprobs = host[2:] if step.wants_logprobs else None
        updates: list[RequestUpdate] = []
        drafted = accepted_total = 0
        for (request, _row, index), draft, start in zip(step.entries, step.drafts, step.starts):
            k = len(draft)
            run = accepted[start : start + k]
            n_accepted = int(np.argmin(run)) if not run.all() else k
            self.policy.verified(request.request_id, n_accepted, k)
            drafted += k
            accepted_total += n_accepted
            request.num_draft_tokens += k
            request.num_accepted_draft_tokens += n_accepted
            for j in range(n_accepted):
                self.num_accepted_per_pos[j] += 1
            outputs = request.output_token_ids
            if request.state is _COMPLETE or index >= len(outputs):
                continue  # aborted while the step ran
            try:
                tokens = token_ids[start : start + n_accepted + 1]
                updates.append(apply_verified(requests, self.kv, request, index, tokens, start, logprobs))
            except Exception as exc:  # host bookkeeping of one request: fail it alone
                updates += requests.fail([request], exc, "applying verified tokens")
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted_total
        self.num_speculative_steps += 1
        self.num_verified_rows += len(step.entries)
        rows = len(step.entries)
        step.stats.setdefault("specDecodingStats", {}).update(
            numDraftTokens=drafted,
            numAcceptedTokens=accepted_total,
            numRequestsWithDraftTokens=rows,
            acceptanceLength=(accepted_total + rows) / rows if rows else 1.0,
        )
        return updates

    # ------------------------------------------------------------------ warm-up
    def warmup(
        self, runner: Any, planner: Planner, num_sampler_rows: int, max_seq_len: int, all_variants: bool = True
    ) -> None:
        """Compile, and run once on empty steps, every program speculation runs
        (`jaxllm.engine.speculation_warmup`)."""
        warm_up_speculation(self, runner, planner, num_sampler_rows, max_seq_len, all_variants)
