"""Server metrics: Prometheus text at /metrics, TensorRT-LLM's iteration stats as JSON.

Per request (observed when a response is released): requests by finish reason (vLLM's
`stop`, `length` and `abort`: a client that disconnected, an explicit abort or a timeout), prompt and
generation tokens, time to first token, time per output token after the first, and
end-to-end latency, all from the request's arrival time. Per scrape: running and waiting
requests and KV cache usage, read from the engine between two steps. Names follow vLLM's
(`jaxllm:` instead of `vllm:`), so existing dashboards need only the prefix changed.

Where the engine thread's step time goes (`EngineTiming`, `jaxllm.engine.step_output`) is
mirrored as counters: steps, blocking device reads and the seconds spent in them, and the
host time with every device wait excluded, in wall and CPU time. A steady decode step
makes one blocking read (the previous step's tokens); more per step means the engine
thread waits on the device somewhere the overlap scheduler cannot hide.

The executor hands each iteration's stats out once; `IterationStats` keeps the most recent
ones in a window, so reading them (GET /v1/iteration_stats) never takes them from another
reader.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxllm.engine.background_compiles import compile_counts

if TYPE_CHECKING:
    from jaxllm.executor.executor import GenerationExecutor
    from jaxllm.executor.result import GenerationResult

PROMETHEUS_CONTENT_TYPE = CONTENT_TYPE_LATEST
ABORT_REASON = "abort"  # vLLM's finished_reason of requests that ended before stop / length
ABORTED = frozenset({"cancelled", "timeout", "abort"})  # engine finish reasons counted as ABORT_REASON
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TPOT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class IterationStats:
    """The last `window` iteration stats of the executor, readable any number of times."""

    def __init__(self, executor: GenerationExecutor, window: int = 1000) -> None:
        self._executor = executor
        self._window: collections.deque = collections.deque(maxlen=window)
        self._lock = threading.Lock()

    def _refresh_locked(self) -> None:
        if self._executor.is_healthy:
            self._window.extend(self._executor.get_stats(0))

    def read(self) -> list[dict]:
        """Every buffered iteration's stats, oldest first (nothing is removed)."""
        with self._lock:
            self._refresh_locked()
            return list(self._window)

    def latest(self) -> Optional[dict]:
        with self._lock:
            self._refresh_locked()
            return self._window[-1] if self._window else None


class ServerMetrics:
    """Prometheus metrics of one server, in a registry of its own."""

    def __init__(self, executor: GenerationExecutor, model_name: str) -> None:
        self.executor = executor
        self.iteration_stats = IterationStats(executor)
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.requests = Counter(
            "jaxllm:request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("jaxllm:prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r)
        self.generation_tokens = Counter(
            "jaxllm:generation_tokens", "Generated tokens of finished requests.", labels, registry=r
        )
        self.ttft = Histogram(
            "jaxllm:time_to_first_token_seconds",
            "Arrival to first generated token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "jaxllm:time_per_output_token_seconds",
            "Mean time per generated token after the first, per request.",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "jaxllm:e2e_request_latency_seconds", "Arrival to the last token.", labels, buckets=_E2E_BUCKETS, registry=r
        )
        self.running = Gauge(
            "jaxllm:num_requests_running", "Requests holding KV cache (scheduled).", labels, registry=r
        )
        self.waiting = Gauge("jaxllm:num_requests_waiting", "Requests queued for KV cache.", labels, registry=r)
        self.kv_usage = Gauge(
            "jaxllm:kv_cache_usage_perc", "Share of KV cache blocks in use (0 to 1).", labels, registry=r
        )
        self.kv_blocks = Gauge("jaxllm:kv_cache_blocks", "KV cache blocks in the pool.", labels, registry=r)
        self.kv_free_blocks = Gauge(
            "jaxllm:kv_cache_free_blocks", "KV cache blocks a new request can take.", labels, registry=r
        )
        # Disaggregated serving (a worker with cache_transceiver_config).
        self.kv_held = Gauge(
            "jaxllm:kv_transfer_held_requests",
            "Context-only requests whose KV blocks wait for a generation worker.",
            labels,
            registry=r,
        )
        self.kv_transfer_seconds = Histogram(
            "jaxllm:kv_transfer_seconds",
            "Pulling one generation-only request's KV blocks from its context worker.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.kv_transfer_bytes = Counter(
            "jaxllm:kv_transfer_bytes", "KV bytes pulled from context workers.", labels, registry=r
        )
        self.kv_transfers = Counter(
            "jaxllm:kv_transfer_requests",
            "Requests whose KV blocks were pulled, by transport (TCP, SHM).",
            ["model_name", "backend"],
            registry=r,
        )
        # The host KV tier (kv_cache_config.host_cache_size); engine totals mirrored as counters.
        self.host_blocks = Gauge("jaxllm:kv_cache_host_blocks", "Host KV tier blocks.", labels, registry=r)
        self.host_free_blocks = Gauge(
            "jaxllm:kv_cache_host_free_blocks", "Host KV tier blocks holding nothing.", labels, registry=r
        )
        self.onboarding_requests = Gauge(
            "jaxllm:kv_cache_onboarding_requests",
            "Requests waiting for KV blocks coming back from the host tier.",
            labels,
            registry=r,
        )
        self.host_counters = {
            field: Counter(name, text, labels, registry=r)
            for field, name, text in (
                ("hostReusedBlocks", "jaxllm:kv_cache_host_hits", "Prompt blocks reused from the host tier."),
                ("offloadedBlocks", "jaxllm:kv_offloaded_blocks", "KV blocks copied from the device to the host tier."),
                ("onboardedBlocks", "jaxllm:kv_onboarded_blocks", "KV blocks copied from the host tier back."),
                ("offloadedBytes", "jaxllm:kv_offloaded_bytes", "Bytes copied from the device to the host tier."),
                ("onboardedBytes", "jaxllm:kv_onboarded_bytes", "Bytes copied from the host tier to the device."),
                ("copyTimeMS", "jaxllm:kv_host_copy_seconds", "Engine-thread time spent on host tier copies."),
            )
        }
        self._host_totals: dict[str, float] = {}
        self.compiles_pending = Gauge(
            "jaxllm:num_compiles_pending",
            "Programs left to compile in the background after ready (queued, under way or held for idle time).",
            labels,
            registry=r,
        )
        self.compiles_done = Gauge(
            "jaxllm:num_compiles_done", "Programs compiled in the background after ready.", labels, registry=r
        )
        # Speculative decoding (vLLM's names): engine totals, counted up to on each scrape.
        self.spec_counters = {
            "num_drafts": Counter(
                "jaxllm:spec_decode_num_drafts",
                "Rows that verified drafts (one per request and step).",
                labels,
                registry=r,
            ),
            "num_draft_tokens": Counter(
                "jaxllm:spec_decode_num_draft_tokens", "Draft tokens verified.", labels, registry=r
            ),
            "num_accepted_tokens": Counter(
                "jaxllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels, registry=r
            ),
        }
        self.spec_accepted_per_pos = Counter(
            "jaxllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.",
            ["model_name", "position"],
            registry=r,
        )
        self._spec_seen: dict = {}
        # Engine step timing (EngineTiming): engine totals, counted up to on each scrape.
        self.engine_counters = {
            field: Counter(name, text, labels, registry=r)
            for field, name, text in (
                ("steps", "jaxllm:engine_steps", "Engine steps (iterations of the engine loop)."),
                (
                    "blocking_reads",
                    "jaxllm:engine_blocking_device_reads",
                    "Blocking reads of device values by the engine thread inside steps.",
                ),
                (
                    "blocking_read_seconds",
                    "jaxllm:engine_blocking_device_read_seconds",
                    "Engine-thread wall time inside blocking device reads.",
                ),
                (
                    "dispatch_wait_seconds",
                    "jaxllm:engine_dispatch_wait_seconds",
                    "Engine-thread time blocked inside program calls (dispatch wall minus CPU time).",
                ),
                (
                    "host_wall_seconds",
                    "jaxllm:engine_host_wall_seconds",
                    "Engine step wall time with every device wait excluded.",
                ),
                ("host_cpu_seconds", "jaxllm:engine_host_cpu_seconds", "Engine-thread CPU time inside steps."),
            )
        }
        self._engine_seen: dict[str, float] = {}
        self.model_name = model_name
        self._labels = {"model_name": model_name}
        for counter in self.engine_counters.values():  # on the page from the first scrape, at 0
            counter.labels(**self._labels)

    def observe(self, results: Iterable[GenerationResult], aborted: Collection[GenerationResult] = ()) -> None:
        """Count released results (call once per result). An unfinished one counts only when
        it is in `aborted` (its response aborted it: it finishes later, unobserved), as `abort`
        with the tokens it had."""
        now = time.monotonic()
        for result in results:
            if not result.finished:
                if result in aborted:
                    self.requests.labels(self.model_name, ABORT_REASON).inc()
                    self.prompt_tokens.labels(**self._labels).inc(len(result.prompt_token_ids))
                    self.generation_tokens.labels(**self._labels).inc(sum(len(o.token_ids) for o in result.outputs))
                continue
            outputs = result.outputs
            reason = outputs[0].finish_reason if outputs else None
            reason = ABORT_REASON if reason in ABORTED else reason
            self.requests.labels(self.model_name, reason or "unknown").inc()
            self.prompt_tokens.labels(**self._labels).inc(len(result.prompt_token_ids))
            generated = sum(len(o.token_ids) for o in outputs)
            self.generation_tokens.labels(**self._labels).inc(generated)
            arrival = result.request.arrival_time
            finished = result.finished_at or now
            self.e2e.labels(**self._labels).observe(max(0.0, finished - arrival))
            first = result.first_token_at
            if first is not None and generated:
                self.ttft.labels(**self._labels).observe(max(0.0, first - arrival))
                per_seq = max(len(o.token_ids) for o in outputs)
                if per_seq > 1:
                    self.tpot.labels(**self._labels).observe(max(0.0, finished - first) / (per_seq - 1))

    def observe_kv_transfer(self, seconds: float, num_bytes: int, backend: str) -> None:
        """One generation-only request's blocks pulled from its context worker."""
        self.kv_transfer_seconds.labels(**self._labels).observe(seconds)
        self.kv_transfer_bytes.labels(**self._labels).inc(num_bytes)
        self.kv_transfers.labels(self.model_name, backend).inc()

    def _engine_state(self) -> Optional[dict]:
        """Running/waiting requests and KV blocks, read on the engine thread between steps."""

        def read(engine) -> dict:
            kv = engine.kv_cache_manager.get_kv_cache_stats()
            waiting = engine.num_queued
            transceiver = getattr(engine, "kv_transceiver", None)
            compiles = compile_counts(engine)
            offload = getattr(engine, "kv_offload", None)
            spec = getattr(engine, "speculation", None)
            timing = getattr(engine, "timing", None)
            return {
                "timing": None
                if timing is None
                else {field: getattr(timing, field, 0) for field in self.engine_counters},
                "host": None if offload is None else offload.stats(),
                "spec": None
                if spec is None
                else {
                    "num_drafts": spec.num_verified_rows,
                    "num_draft_tokens": spec.num_draft_tokens,
                    "num_accepted_tokens": spec.num_accepted_tokens,
                    "per_pos": list(spec.num_accepted_per_pos),
                },
                "running": len(engine.active) - waiting,
                "waiting": waiting,
                "used": kv.used_num_blocks,
                "total": kv.max_num_blocks,
                "free": kv.free_num_blocks,
                "held": None if transceiver is None else transceiver.num_held,
                "compiles_pending": compiles["pending"],
                "compiles_done": compiles["done"],
            }

        if not self.executor.is_healthy:
            return None
        try:
            return self.executor.call_on_engine(read, timeout=2.0)
        except Exception:  # busy or shutting down: report from the latest iteration instead
            latest = self.iteration_stats.latest()
            if latest is None:
                return None
            kv = latest.get("kvCacheStats", {})
            waiting = latest.get("numQueuedRequests", 0)
            return {
                "running": latest.get("numActiveRequests", 0) - waiting,
                "waiting": waiting,
                "used": kv.get("usedNumBlocks", 0),
                "total": kv.get("maxNumBlocks", 0),
                "free": kv.get("freeNumBlocks", 0),
                "held": kv.get("heldRequests"),
                "host": kv if "hostMaxNumBlocks" in kv else None,
            }

    def _observe_host_tier(self, stats: dict) -> None:
        self.host_blocks.labels(**self._labels).set(stats["hostMaxNumBlocks"])
        self.host_free_blocks.labels(**self._labels).set(stats["hostFreeNumBlocks"])
        self.onboarding_requests.labels(**self._labels).set(stats.get("onboardingRequests", 0))
        for field, counter in self.host_counters.items():
            total = stats[field] / 1e3 if field == "copyTimeMS" else stats[field]
            delta = total - self._host_totals.get(field, 0)
            if delta > 0:
                counter.labels(**self._labels).inc(delta)
                self._host_totals[field] = total

    def _count_spec(self, totals: dict) -> None:
        """Count the speculative decoding counters up to the engine's totals."""
        seen = self._spec_seen
        for name, counter in self.spec_counters.items():
            counter.labels(**self._labels).inc(max(0, totals[name] - seen.get(name, 0)))
            seen[name] = max(totals[name], seen.get(name, 0))
        for position, value in enumerate(totals["per_pos"]):
            key = ("per_pos", position)
            self.spec_accepted_per_pos.labels(self.model_name, str(position)).inc(max(0, value - seen.get(key, 0)))
            seen[key] = max(value, seen.get(key, 0))

    def _count_engine_timing(self, totals: dict) -> None:
        """Count the engine timing counters up to the engine's totals; a total below the last
        one seen was reset (`LLMEngine.reset_timing`) and counts from zero again."""
        seen = self._engine_seen
        for field, counter in self.engine_counters.items():
            total = totals[field]
            last = seen.get(field, 0)
            delta = total - last if total >= last else total
            if delta > 0:
                counter.labels(**self._labels).inc(delta)
            seen[field] = total

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric, gauges refreshed now."""
        state = self._engine_state()
        if state is not None:
            self.running.labels(**self._labels).set(max(0, state["running"]))
            self.waiting.labels(**self._labels).set(state["waiting"])
            self.kv_blocks.labels(**self._labels).set(state["total"])
            self.kv_usage.labels(**self._labels).set(state["used"] / state["total"] if state["total"] else 0.0)
            self.kv_free_blocks.labels(**self._labels).set(state["free"])
            if state["held"] is not None:
                self.kv_held.labels(**self._labels).set(state["held"])
            if state["host"] is not None:
                self._observe_host_tier(state["host"])
            if "compiles_pending" in state:  # read from the engine (not from the latest iteration)
                self.compiles_pending.labels(**self._labels).set(state["compiles_pending"])
                self.compiles_done.labels(**self._labels).set(state["compiles_done"])
            if state.get("spec") is not None:
                self._count_spec(state["spec"])
            if state.get("timing") is not None:
                self._count_engine_timing(state["timing"])
        return generate_latest(self.registry)
