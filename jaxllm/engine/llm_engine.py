"""The engine loop: plan (host) -> run the plan (devices) -> apply the sampled tokens.

`LLMEngine` is a facade over parts built by `jaxllm.engine.builder`: the planner (scheduler,
KV block manager, batch building) turns the active requests (`jaxllm.engine.requests`) into
a `StepPlan` of plain host arrays; the runner (`jaxllm.engine.model_runner`) executes it on
the device mesh and returns a `StepOutput`; the read-back (`jaxllm.engine.token_readback`)
applies the sampled tokens, stops and finishes, and reports updates.

Requests are checked once, at admission (`jaxllm.engine.admission`, with the combination
rules of `jaxllm.engine.capabilities`), so an admitted request cannot make a step fail. As
a backstop, an exception while building a step's host inputs fails only the requests that
caused it (the planner finds them, `Planner.build_step`), or else that step's requests, and
the engine goes on; only a failure of the device program itself propagates.

With the overlap scheduler (default) step N+1 is scheduled and dispatched before the
tokens of step N are read back, so the device never waits on Python: a generation
request whose previous token is still on the device carries a placeholder on the host
and the step reads the real token from the previous step's output. Stops are therefore
seen one step late; the extra token is discarded.

Each step's time is split in `self.timing` (`EngineTiming`): every read of a device value
goes through `jaxllm.engine.device_reads`, which counts and times it, and the time the
thread was blocked inside the program calls (their wall minus CPU time) is measured at the
dispatch, so host time excludes every device wait and a step that makes more than its one
read of the previous step's tokens shows in `blocking_reads`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Optional

from jaxllm.engine.admission import (
    AdmissionLimits,
    AdmittedRequest,
)
from jaxllm.engine.background_compiles import ACTIVITY
from jaxllm.engine.builder import build_engine
from jaxllm.engine.compile_ahead import cap_token_budget
from jaxllm.engine.device_reads import thread_tally
from jaxllm.engine.engine_config import EngineConfig
from jaxllm.engine.engine_programs import build_engine_programs
from jaxllm.engine.followers import mirror, open_session
from jaxllm.engine.guided_matchers import GuidedMatchers
from jaxllm.engine.kv_transceiver import build_transceiver
from jaxllm.engine.logits_outputs import plan_logits_outputs
from jaxllm.engine.lora_adapters import EngineAdapters
from jaxllm.engine.request_intake import RequestIntake
from jaxllm.engine.requests import RequestTable
from jaxllm.engine.speculation import build_speculation
from jaxllm.engine.step_output import EngineTiming, PendingStep, step_stats
from jaxllm.engine.step_updates import RequestUpdate, StepUpdates
from jaxllm.engine.token_readback import TokenReadback
from jaxllm.llm_args import CapacitySchedulerPolicy, DisaggregatedParams
from jaxllm.llm_request import LlmRequest, LlmRequestState
from jaxllm.lora import LoraAdapter, LoRARequest
from jaxllm.sampling import SamplingParams

_COMPLETE = LlmRequestState.GENERATION_COMPLETE


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Multi-host leader: the followers build this same runner from the config (None otherwise).
        session = open_session(config)
        parts = build_engine(config, leader_session=session)
        device = parts.device
        self.model_config, self.mesh, self.runner = device.model_config, device.mesh, device.runner
        self.max_seq_len, self.max_blocks_per_seq = device.max_seq_len, device.max_blocks_per_seq
        self.attention_backend, self.moe_backend = device.attention_backend, device.moe_backend
        self.expert_statistics, self.executable_store = device.expert_statistics, device.executable_store
        self.attention_dp = config.enable_attention_dp
        self.tokenizer, self.eos_ids = parts.tokenizer, parts.eos_ids
        self.planner, self.kv_cache_manager, self.scheduler = parts.planner, parts.kv_cache_manager, parts.scheduler
        self.num_sampler_rows = parts.num_sampler_rows
        self.capabilities = parts.capabilities
        self.lora_slots, self.kv_events = parts.lora_slots, parts.kv_events
        self.adapters = EngineAdapters(parts.adapters, parts.lora_slots, self.runner, config.max_lora_rank)
        self.load_balancer = parts.load_balancer
        # Host KV tier: copies started before each launch, arrived onboards written before scheduling.
        self.kv_offload = parts.kv_offload
        # Programs are launched through this: on a multi-host leader every call is first sent
        # to the followers, which make it too (`jaxllm.engine.followers`).
        self.step_runner = mirror(self.runner, session, config.multihost_plan_channel)
        if self.kv_offload is not None and session is not None:  # each follower copies its own shards
            self.kv_offload.use_copier(self.step_runner.mirror_copier(self.kv_offload.copier))
        # Steps run in a compiled bucket while the best fit compiles (jaxllm.engine.compile_ahead);
        # the small decode buckets (EngineConfig.decode_batch_sizes) have a compiler of their own;
        # a step whose sampler variant is not compiled runs the general one (sampler_variants).
        self.programs = build_engine_programs(
            config,
            planner=self.planner,
            step_runner=self.step_runner,
            runner=self.runner,
            num_sampler_rows=self.num_sampler_rows,
            max_seq_len=self.max_seq_len,
            vocab_size=self.model_config.vocab_size,
            logits_outputs=self.capabilities.logits_outputs is None,
            compile_ahead=config.compile_ahead and session is None and not self.attention_dp,
        )
        self.program_warmup, self.sampler_variants = self.programs.warmup, self.programs.sampler_variants
        self.bucket_compiler, self.decode_compiler = self.programs.bucket_compiler, self.programs.decode_compiler
        # Speculative decoding (jaxllm.engine.speculation): drafts need each request's last
        # token on the host, so a step that drafts is not overlapped (the step before it is read
        # back first, and it is read back at once), and it ends the steady decode batch (steps
        # that do not draft run the steady-decode fast path; not under attention DP).
        self.speculation = build_speculation(config, planner=self.planner, runner=self.runner, tokenizer=self.tokenizer)
        if self.speculation is not None and session is not None:  # every process verifies and drafts
            self.step_runner.mirror_speculation(self.speculation)
        if self.speculation is not None and self.attention_dp:
            self.planner.steady_decode = False
        if self.sampler_variants is not None and self.speculation is None:
            # A token bucket's sampler runs over its live rows, as a decode bucket's does.
            self.planner.sampler_row_sizes = self.sampler_variants.row_sizes = list(self.planner.decode_batch_sizes)
        # Pausing moves generated tokens into the prompt, which needs them on the host.
        self.overlap = (
            not config.disable_overlap_scheduler
            and config.scheduler_config.capacity_scheduler_policy != CapacitySchedulerPolicy.MAX_UTILIZATION
        )
        # Grammar matchers of structured-output requests (jaxllm.engine.guided_matchers).
        self.guided = GuidedMatchers(self.tokenizer, self.model_config.vocab_size, self.eos_ids)
        if not self.attention_dp:
            self.planner.guided_matchers = self.guided
        self.requests = RequestTable(
            planner=self.planner,
            kv_cache_manager=self.kv_cache_manager,
            lora_slots=self.lora_slots,
            guided_matchers=self.guided,
        )
        # Disaggregated serving: context-only requests' blocks held for hand-over, generation-only
        # requests' blocks written in (jaxllm.engine.kv_transceiver); None when not configured.
        self.kv_transceiver = build_transceiver(config, self.runner, self.kv_cache_manager)
        if self.kv_transceiver is not None:
            self.requests.before_free = self.kv_transceiver.before_free
        self.readback = TokenReadback(
            requests=self.requests,
            kv_cache_manager=self.kv_cache_manager,
            planner=self.planner,
            copy_blocks=self._copy_blocks,
            expert_statistics=self.expert_statistics,
            load_balancer=self.load_balancer,
        )
        self._pending: Optional[PendingStep] = None
        # While the request table is unchanged and every request of a steady decode step stays
        # below max_tokens, the next step's candidates are that step's requests, found without
        # a pass over the active requests: (requests, the table's change count then).
        self._steady_candidates: Optional[tuple[list[LlmRequest], int]] = None
        # Steady decode batches keep their tokens in a `DecodeTokenLog` instead of writing
        # them into every request each step (jaxllm.engine.token_log); False writes them.
        self.token_log = True
        self.iteration = 0
        self.iteration_stats: list[dict] = []
        self.max_iteration_stats = 1000
        self.timing = EngineTiming()
        self._failed: list[RequestUpdate] = []  # requests failed while building a step
        # Called after each dispatch with (time the forward was enqueued, sampler output): lets a
        # benchmark watch when each step's device work ends without syncing the step loop.
        self.on_dispatch: Optional[Callable[[float, Any], None]] = None
        self.intake = RequestIntake(
            AdmissionLimits.of_engine(
                config,
                self.model_config.vocab_size,
                self.max_seq_len,
                self.eos_ids,
                self.kv_cache_manager,
                self.capabilities,
            ),
            self.tokenizer,
            self.guided,
            self.capabilities,
            self.kv_cache_manager,
            self.adapters,
            self.requests,
            self.attention_dp,
        )

    @property
    def active(self) -> Mapping[int, LlmRequest]:
        """The unfinished requests by id (a read-only view)."""
        return self.requests.view()

    def resolve_lora(self, lora_request: Any) -> Optional[LoraAdapter]:
        """The checked adapter of `lora_request` (None for the base model); ValueError when it
        cannot be served. Safe from any thread; adapters are read once and kept."""
        return self.adapters.resolve(lora_request)

    # ------------------------------------------------------------------ compiling
    def reset_timing(self) -> None:
        self.timing = EngineTiming()

    def token_buckets(self) -> list[int]:
        return self.planner.token_buckets()

    def decode_bucket(self) -> int:
        """The token bucket every decoding step fits: the smallest holding `max_batch_size` tokens."""
        return self.program_warmup.decode_bucket()

    def warmup(
        self, all_variants: bool = True, progress: Optional[Callable[[int, int], None]] = None, background: bool = False
    ) -> None:
        """Compile everything a request can reach before serving, so nothing compiles later:
        the model forward for every token bucket and small decode bucket and the sampler for
        every variant of its static switches (`all_variants=False`: only the default greedy sampler). Runs empty
        batches, which write nothing to the KV cache. `progress(done, total)` is called after
        each compiled piece (for a progress bar).

        The programs are independent, so they compile at once on the runner's compile threads
        (`EngineConfig.compile_workers`); the samplers once the smallest bucket's forward gave
        the logits they take. Then each runs once.

        `background`: return once what a lone user needs is compiled, the decode token bucket
        (the smallest holding `max_batch_size` tokens: every decoding step and a short prompt fit
        it), a prompt bucket (`ProgramWarmup.first_buckets`) and the one-row decode bucket, with
        the greedy and the general sampler. A step whose
        best bucket is not compiled runs padded in a compiled one (see
        `jaxllm.engine.compile_ahead`), one whose sampler variant is not compiled runs the
        general one (`jaxllm.engine.sampler_variants`); the better fits compile in the
        background (`on_idle`, `jaxllm.engine.background_compiles`). Needs `compile_ahead`
        (else everything compiles before returning)."""
        self.program_warmup.run(all_variants, progress, background)
        if self.speculation is not None:
            self.speculation.warmup(
                self.step_runner, self.planner, self.num_sampler_rows, self.max_seq_len, all_variants
            )
        if self.kv_transceiver is not None:  # the hand-over's block reads and writes
            self.kv_transceiver.warmup(self.max_blocks_per_seq)
        if self.kv_offload is not None:  # the host tier's block reads and writes
            self.kv_offload.warmup()
        if self.load_balancer is not None:
            self.load_balancer.warm_up(self.runner.params)
        self.guided.prepare()  # the first constrained request does not build the grammar tokenizer
        self.adapters.warmup()

    def on_idle(self) -> None:
        """Nothing to run: compile, on the compile threads, the buckets steps asked for and
        those a background warm-up left for idle time. Called by the engine's driver when no
        request arrived for a while (not at the end of every run: an engine that gets its next
        request at once never stayed idle)."""
        self.programs.on_idle()

    # ------------------------------------------------------------------ requests
    def next_request_id(self) -> int:
        return self.intake.next_request_id()

    def validate_request(
        self, prompt_token_ids: Any, params: Any, *, priority: Any = 0.0, lora_request: Any = None
    ) -> AdmittedRequest:
        """Admission checks (ValueError naming the field); safe to call from any thread, and
        what the executor calls when a request is submitted."""
        return self.intake.validate(prompt_token_ids, params, priority=priority, lora_request=lora_request)

    def validate_prompt(self, prompt_token_ids: Any, params: Any) -> None:
        """Alias of `validate_request` with the default priority."""
        self.validate_request(prompt_token_ids, params)

    def add_request(
        self,
        prompt_token_ids: Any,
        sampling_params: Optional[SamplingParams] = None,
        *,
        request_id: Optional[int] = None,
        priority: float = 0.0,
        arrival_time: Optional[float] = None,
        sequence_index: int = 0,
        lora_request: Optional[LoRARequest] = None,
        kv_cache_retention_config: Any = None,
        admitted: Optional[AdmittedRequest] = None,
        disaggregated_params: Optional[DisaggregatedParams] = None,
    ) -> LlmRequest:
        """Admit a request (ValueError naming the field if it breaks a limit). `lora_request`:
        the LoRA adapter it runs with (the engine needs enable_lora); `kv_cache_retention_config`:
        retention priorities of its cached KV blocks (`jaxllm.KvCacheRetentionConfig`);
        `disaggregated_params`: a context-only or generation-only request (needs
        cache_transceiver_config); `admitted`: `validate_request`'s result, when already run."""
        request = self.intake.create(
            prompt_token_ids,
            SamplingParams() if sampling_params is None else sampling_params,
            request_id=request_id,
            priority=priority,
            arrival_time=arrival_time,
            sequence_index=sequence_index,
            lora_request=lora_request,
            kv_cache_retention_config=kv_cache_retention_config,
            admitted=admitted,
        )
        if disaggregated_params is not None and disaggregated_params.request_type != "context_and_generation":
            if self.kv_transceiver is None:
                raise ValueError("disaggregated_params: this engine was built without cache_transceiver_config")
            first = self.kv_transceiver.admit(request, disaggregated_params)
            if first is not None:  # generation-only: its first token is reported by the next step
                self.kv_transceiver.handed_over.append(first)
                if first.finished:
                    return request
        self.requests.add(request)
        return request

    def get_kv_cache_events(self, timeout: Optional[float] = None, max_events: Optional[int] = None) -> list[dict]:
        """KV cache events since the previous call, at most `max_events` of them, oldest first
        (any thread; waits up to `timeout` seconds for one). Empty unless
        `kv_cache_config.event_buffer_max_size > 0`."""
        return [] if self.kv_events is None else self.kv_events.get(timeout, max_events)

    def abort_request(self, request_id: int) -> Optional[LlmRequest]:
        """Finish a request as 'cancelled' and free its blocks at once."""
        return self.requests.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        handed_over = self.kv_transceiver is not None and bool(self.kv_transceiver.handed_over)
        return bool(len(self.requests)) or self._pending is not None or handed_over

    @property
    def pending_step(self) -> Optional[PendingStep]:
        """The dispatched step whose tokens are not read back yet (None when there is none)."""
        return self._pending

    @property
    def num_queued(self) -> int:
        """Active requests that hold no KV sequence yet (waiting to start, or paused)."""
        kv = self.kv_cache_manager
        if not self.requests.num_beam_search and not self.attention_dp:
            # Every KV sequence belongs to an active request (beams aside): no pass needed.
            return len(self.requests) - kv.num_sequences
        return sum(1 for r in self.requests if not kv.has_sequence(r))

    @staticmethod
    def logits_outputs(request: LlmRequest) -> Optional[dict]:
        """A finished request's logits outputs (`context_logits`, `generation_logits`,
        `prompt_logprobs`, those it asked for), or None when it asked for none."""
        record = request.logits_record
        if record is None:
            return None
        return record.outputs(request.sampling_params, len(request.output_token_ids)) or None

    # ------------------------------------------------------------------ the step
    def _schedulable(self) -> list[LlmRequest]:
        steady = self._steady_candidates
        if steady is not None and steady[1] == self.requests.changes:
            return steady[0]
        self.planner.materialize_tokens()  # the lengths below must count every token
        return [
            r
            for r in self.requests
            if len(r.output_token_ids) < r.sampling_params.max_tokens and r.state is not _COMPLETE
        ]

    def step(self) -> StepUpdates:
        """Run one iteration; returns the updates of the step whose tokens were read back
        (iterate it for one `RequestUpdate` per request; `StepUpdates.decoded` holds the
        plain decode rows batched)."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        reads = thread_tally()
        reads_before, read_seconds_before = reads.count, reads.seconds
        dispatch_wait_before = self.timing.dispatch_wait_seconds
        updates = StepUpdates()
        candidates = self._schedulable()
        pending = self._pending
        if pending is not None and (pending.beam_entries or pending.processor_requests):
            # A beam-search request's next beams are chosen on the host from the in-flight
            # step's candidates, and a host logits processor reads every previous token: such a
            # request sits this step out; the other requests stay overlapped.
            waiting = {id(entry[0].beam) for entry in pending.beam_entries or ()}
            held = {id(r) for r in pending.processor_requests}
            candidates = [r for r in candidates if id(r) not in held and (r.beam is None or id(r.beam) not in waiting)]
        sat_out = False  # a constrained request waits for its token (jaxllm.engine.guided_matchers)
        if pending is not None and self.guided.num_active:
            kept = self.guided.sit_out(candidates, pending.entries)
            sat_out, candidates = len(kept) < len(candidates), kept
        if (
            pending is not None
            and self.requests.num_needing_history
            and any(r.sampling_params.needs_history for r in candidates)
        ):
            in_flight = {id(entry[0]) for entry in pending.entries}
            if any(r.sampling_params.needs_history and id(r) in in_flight for r in candidates):
                # Penalties and bad-word lists need every previous token on the host: no overlap here.
                updates += self._read_back(pending)
                self._pending = None
                candidates = self._schedulable()
        drained = 0.0  # seconds spent reading back the step before a drafting step
        if pending is not None and self._pending is not None and self.speculation is not None:
            if self.speculation.wants_drafts():  # drafts need every last token on the host
                drain_start = time.perf_counter()
                updates += self._read_back(pending)
                self._pending = None
                candidates = self._schedulable()
                drained = time.perf_counter() - drain_start
        dispatched = self._dispatch(candidates)
        updates += self._failed
        self._failed = []
        if self.kv_transceiver is not None and self.kv_transceiver.handed_over:
            updates += self.kv_transceiver.handed_over
            self.kv_transceiver.handed_over = []
        if self._pending is not None:
            updates += self._read_back(self._pending)
        self._pending = dispatched
        self._steady_candidates = None
        if dispatched is not None and dispatched.decode is not None and not sat_out:
            decode = dispatched.decode
            # Each request now holds index + 1 outputs; it stays a candidate below max_tokens.
            if not self.readback.stops_of(decode, dispatched.decode_index).length_due(dispatched.decode_index):
                self._steady_candidates = (decode.requests, self.requests.changes)
        if self._pending is not None and (not self.overlap or self._pending.speculative is not None):
            updates += self._read_back(self._pending)
            self._pending = None
        elapsed = time.perf_counter() - started
        if self.speculation is not None:  # the previous step's device time is not this step's
            self.speculation.observe(elapsed - drained)
        timing = self.timing
        waited = reads.seconds - read_seconds_before
        timing.steps += 1
        timing.step_seconds += elapsed
        timing.host_cpu_seconds += time.thread_time() - cpu_started
        timing.blocking_reads += reads.count - reads_before
        timing.blocking_read_seconds += waited
        timing.host_seconds += elapsed - waited
        timing.host_wall_seconds += elapsed - waited - (timing.dispatch_wait_seconds - dispatch_wait_before)
        if self.bucket_compiler is not None:  # idle-time compiles wait while engines are busy
            ACTIVITY.set_busy(self, self.has_unfinished_requests())
        if dispatched is not None:
            dispatched.stats["iterLatencyMS"] = elapsed * 1e3
            dispatched.stats["numCompletedRequests"] = updates.num_finished
            self._record_stats(dispatched.stats)
        return updates

    def _read_back(self, pending: PendingStep) -> StepUpdates:
        """The updates of a dispatched step: its rows, then its speculating rows."""
        updates = self.readback.process(pending)
        if pending.speculative is not None and self.speculation is not None:
            updates += self.speculation.read_back(pending.speculative, self.requests)
        return updates

    def _dispatch(self, candidates: list[LlmRequest]) -> Optional[PendingStep]:
        """Plan and launch one step. Requests that make planning it fail are failed
        (collected in `self._failed`); the step runs for the others."""
        if not candidates:
            return None
        if self.bucket_compiler is not None:  # no step waits for a larger bucket to compile
            cap_token_budget(self.scheduler, self.programs.token_budget(self.requests.context_logits_pending()))
        offload = self.kv_offload
        try:
            if offload is not None:  # onboarded blocks that arrived: their requests may run now
                offload.poll()
            output = self.planner.schedule(candidates, self.programs.planner_options(self.requests, self.token_log))
            if output is None and offload is not None and offload.num_waiting:
                offload.poll(wait=True)  # only requests waiting for their blocks: wait for them
                output = self.planner.schedule(candidates, self.programs.planner_options(self.requests, self.token_log))
            if output is None:
                return None
        except Exception as exc:  # no request to single out: those that could run fail
            self._failed += self.requests.fail(candidates, exc, "scheduling a step")
            return None
        spec = self.speculation
        if spec is not None:
            may_draft = self._pending is None and not (
                self.requests.num_logits_requests or self.requests.num_beam_search
            )
            spec.begin_step(output, self.requests, may_draft)
        built = self.planner.build_step(output, None if self._pending is None else self._pending.entries)
        for failed, exc in built.failures:
            self._failed += self.requests.fail(failed, exc, "building a step")
        plan, output = built.plan, built.output
        if plan is None:
            if spec is not None:
                spec.drop_drafts()
            return None
        if spec is not None:
            plan = spec.verification_plan(plan, output)
        self.adapters.write_loads()
        logits = None
        if self.requests.num_logits_requests:
            context = self.programs.context_logits
            plan, logits = plan_logits_outputs(
                plan,
                output,
                self.config.min_token_bucket,
                self.num_sampler_rows,
                None if context is None else context.choose_rows,
            )
        if self.sampler_variants is not None:  # the general variant while its own compiles
            plan = self.sampler_variants.choose(plan)
        balancer = self.load_balancer
        updated_layers = balancer.apply_round(self.runner.params) if balancer is not None else []
        # Wall minus thread CPU time of the dispatch is time blocked in the runtime (a device
        # wait inside a program call); reads made inside it are counted as reads instead.
        reads = thread_tally()
        read_seconds = reads.seconds
        dispatch_start, dispatch_cpu = time.perf_counter(), time.thread_time()
        hook = None if logits is None else logits.processor_hook()
        if self.kv_offload is not None:
            self.kv_offload.flush()
        result = self.step_runner.execute(plan) if hook is None else self.step_runner.execute(plan, host_processor=hook)
        dispatch_wall = time.perf_counter() - dispatch_start
        dispatch_cpu = time.thread_time() - dispatch_cpu
        self.timing.dispatch_seconds += dispatch_wall
        self.timing.dispatch_wait_seconds += max(0.0, dispatch_wall - dispatch_cpu - (reads.seconds - read_seconds))
        if spec is not None:
            spec.after_dispatch(plan, output, result.context_logits)
        if self.on_dispatch is not None:
            self.on_dispatch(result.enqueue_time, result.sampled)
        if balancer is not None:
            balancer.after_forward(result.expert_counts)
        iteration = self.iteration  # index of this step (stats are recorded once it is dispatched)
        writer = self.expert_statistics
        wanted = balancer is not None or (writer is not None and writer.wants(iteration))
        wants_logprobs = bool(self.requests.num_wanting_logprobs) and any(
            r.sampling_params.logprobs is not None for r in output.all_requests()
        )
        num_new = sum(1 for r in output.context_requests if r.is_first_context_chunk)
        entries = self.planner.commit(output)
        if spec is not None:
            entries = spec.take_entries(entries)
        beam_entries = None
        if self.requests.num_beam_search:
            beam_entries = [e for e in entries if e[0].beam is not None]
            if beam_entries:
                entries = [e for e in entries if e[0].beam is None]
        decode = getattr(output.kv_placement, "decode", None)
        if decode is not None and decode.entries is not entries:
            decode = None
        stats = step_stats(output, plan.num_context_tokens, num_new)
        if balancer is not None:
            stats["moeLoadBalancerStats"] = balancer.iteration_stats(updated_layers)
        pending = PendingStep(
            result.sampled,
            entries,
            wants_logprobs,
            stats,
            iteration,
            result.expert_counts if wanted else None,
            balancer.tables if balancer is not None else None,
            beam_entries or None,
        )
        if decode is not None:
            pending.decode, pending.decode_index = decode, entries.index
        if spec is not None:
            pending.speculative = spec.speculative_step(wants_logprobs, stats)
        if logits is not None:
            logits.attach(pending, result)
        return pending

    # ------------------------------------------------------------------ stats
    def close_statistics(self) -> None:
        """Write the expert statistics recorded so far (they are also written once the
        iteration range ends)."""
        if self.expert_statistics is not None:
            self.expert_statistics.save()

    def close(self) -> None:
        """Write pending statistics, stop the load balancer's placement thread and the compile
        threads, and end the multi-host session (the followers drop their runner)."""
        self.close_statistics()
        self.programs.close()
        ACTIVITY.set_busy(self, False)
        if self.load_balancer is not None:
            self.load_balancer.close()
        self.step_runner.close()

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Beam forks' block copies; queued host-tier copies go first (they read blocks the
        fork may overwrite)."""
        if self.kv_offload is not None:
            self.kv_offload.flush()
        self.runner.copy_blocks(pairs)

    def _record_stats(self, stats: dict) -> None:
        self.iteration += 1
        stats.update(
            {
                "timestamp": time.time(),
                "iter": self.iteration,
                "numActiveRequests": len(self.requests),
                "numQueuedRequests": self.num_queued,
                "maxNumActiveRequests": self.config.max_batch_size,
                "maxBatchSizeRuntime": self.config.max_batch_size,
                "maxNumTokensRuntime": self.config.max_num_tokens,
                "kvCacheStats": self.kv_cache_manager.get_kv_cache_stats().to_dict(),
            }
        )
        if self.kv_offload is not None:
            stats["kvCacheStats"].update(self.kv_offload.stats())
        if self.kv_transceiver is not None:
            stats["kvCacheStats"].update(self.kv_transceiver.counts())
        self.iteration_stats.append(stats)
        del self.iteration_stats[: -self.max_iteration_stats]
