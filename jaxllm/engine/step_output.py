"""What one step leaves behind: the runner's `StepOutput` and the engine's `PendingStep`.

`ModelRunner.execute` returns a `StepOutput`: the device arrays a step produced (sampled
tokens, expert counts, logits rows) without waiting for them. The engine wraps it with the
host bookkeeping of that step (which request gets which token) into a `PendingStep`, which
the read-back (`jaxllm.engine.token_readback`) turns into request updates once the tokens
are on the host: one step later under the overlap scheduler.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional

import jax
import numpy as np

from jaxllm.engine.logits_outputs import StepLogitsTargets
from jaxllm.engine.planner import TokenEntry
from jaxllm.kv_cache.manager import DecodeRows
from jaxllm.sampling import SamplerOutput


@dataclass(frozen=True)
class StepOutput:
    """The results of one dispatched step, as device arrays not waited for."""

    sampled: SamplerOutput
    # Expert counts int32 [num_moe_layers, num_experts] (runners built with moe_stats), else None.
    expert_counts: Optional[jax.Array] = None
    # Logits [E, V] of the packed tokens the plan's `context_index` asked for, else None.
    context_logits: Optional[jax.Array] = None
    # Raw logits rows [R, V] the plan's `logits_rows` asked for, else None.
    row_logits: Optional[jax.Array] = None
    # The sampler output of the rows rewritten by host logits processors, computed on the
    # runner's processor thread (None when the step had none).
    processed: Optional[Future] = None
    # time.perf_counter() when the forward was handed to the runtime.
    enqueue_time: float = 0.0

    def device_arrays(self) -> list[jax.Array]:
        """Every device array of the output (what a multi-host follower keeps of a call)."""
        leaves = jax.tree_util.tree_leaves((self.sampled, self.expert_counts, self.context_logits, self.row_logits))
        return [leaf for leaf in leaves if isinstance(leaf, jax.Array)]


@dataclass
class EngineTiming:
    """Where the engine thread's step time goes: host work (scheduling, packing, bookkeeping)
    vs waiting on the device, totals over `steps` calls of `LLMEngine.step`.

    Every wait is excluded from `host_wall_seconds`, so no device wait can pass for host
    work, wherever the thread blocks:

    * `blocking_read_seconds`: wall time inside the step's `blocking_reads`, every read of a
      device value the engine thread made (`jaxllm.engine.device_reads`: the previous step's
      tokens, logprobs, logits outputs, expert counts, drafts, a processors' future);
    * `dispatch_wait_seconds`: time the thread was blocked inside the program calls: the
      dispatch's wall time minus its thread CPU time (`time.thread_time()`), less the reads
      made inside it. A runtime that reads a device value back while dispatching (XLA on a
      GPU reading a `while` loop's device-valued predicate every trip) shows up here; so does
      time the thread was descheduled, on a host whose cores are shared;
    * `host_wall_seconds` = `step_seconds` - `blocking_read_seconds` - `dispatch_wait_seconds`;
    * `host_cpu_seconds`: the engine thread's CPU time in the steps, the figure least
      disturbed by other processes on the cores.

    `host_seconds` (`step_seconds` - `blocking_read_seconds`) still counts dispatch waits,
    as it always did; `device_wait_seconds` is `blocking_read_seconds` (its old name).
    """

    steps: int = 0
    host_seconds: float = 0.0
    # Part of host_seconds spent handing a step to the runtime (input transfer, program calls).
    dispatch_seconds: float = 0.0
    step_seconds: float = 0.0
    host_cpu_seconds: float = 0.0
    host_wall_seconds: float = 0.0
    blocking_reads: int = 0
    blocking_read_seconds: float = 0.0
    dispatch_wait_seconds: float = 0.0

    @property
    def device_wait_seconds(self) -> float:
        """Seconds blocked reading device values back (`blocking_read_seconds`)."""
        return self.blocking_read_seconds

    def as_dict(self) -> dict:
        """Totals and per-step means in ms (the `*_ms` keys), for reports and the executor."""
        steps = max(self.steps, 1)
        out: dict = {"steps": self.steps, "blocking_reads": self.blocking_reads}
        for name in (
            "step_seconds",
            "host_seconds",
            "host_wall_seconds",
            "host_cpu_seconds",
            "dispatch_seconds",
            "dispatch_wait_seconds",
            "blocking_read_seconds",
        ):
            out[name] = getattr(self, name)
            out[name.replace("_seconds", "_ms_per_step")] = getattr(self, name) / steps * 1e3
        out["blocking_reads_per_step"] = self.blocking_reads / steps
        return out


@dataclass
class PendingStep:
    """A dispatched step whose tokens have not been read back yet."""

    sampler_output: SamplerOutput
    entries: list[TokenEntry]  # (request, row, index in output_token_ids); DecodeEntries when steady
    wants_logprobs: bool
    stats: dict
    iteration: int = 0
    expert_counts: Any = None  # device array of the step's expert counts, when statistics are recorded
    slot_tables: Optional[dict] = None  # MoE layer -> slot table the step ran with (online balancer)
    beam_entries: Optional[list[TokenEntry]] = None  # rows of beam-search requests (processed apart)
    # Host logits processors of this step (`jaxllm.engine.logits_processing`): their requests and
    # rows, the future of those rows' sampler output (computed on the runner's processor
    # thread), and the callables' failures, filled on that thread.
    processor_requests: tuple = ()
    processor_rows: tuple = ()
    processed_output: Any = None
    processor_failures: Optional[list] = None
    # Steps where some row asks for logits: who gets which rows, and the device arrays.
    logits_targets: Optional[StepLogitsTargets] = None
    context_logits: Any = None
    # The speculating rows of a speculative step and their verification output
    # (`jaxllm.engine.verified_tokens.SpeculativeStep`), read back after the other rows.
    speculative: Any = None
    row_logits: Any = None
    # A steady decode step (entry i is row i of `decode.requests`): the rows and the index in
    # output_token_ids each row's token goes to, so reading back needs no pass over entries.
    decode: Optional[DecodeRows] = None
    decode_index: Optional[np.ndarray] = None


def step_stats(output: Any, num_context_tokens: int, num_new: int) -> dict:
    """The iteration statistics of a dispatched step (TensorRT-LLM's names)."""
    return {
        "numNewActiveRequests": num_new,
        "inflightBatchingStats": {
            "numScheduledRequests": output.batch_size,
            "numContextRequests": len(output.context_requests),
            "numGenRequests": len(output.generation_requests),
            "numPausedRequests": len(output.paused_requests),
            "numCtxTokens": num_context_tokens,
        },
    }
