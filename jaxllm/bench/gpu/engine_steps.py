"""Per-step numbers of one timed engine run: host time from `engine.timing`, device time from
when each step was enqueued and when its device work was done, and the decode steps'
model-bandwidth and FLOP utilisation (`step_roofline`).

Device busy time of step i (`device_busy`): finish[i] - max(enqueue[i], finish[i-1]), the
time from when the device could start it (it was enqueued, and the previous step was done)
to when its tokens were ready; idle before step i: max(0, enqueue[i] - finish[i-1]).
Finish times come from `jaxllm.bench.host_overhead.DeviceWatcher` (a thread blocking on each
step's tokens). Step i is matched to the engine's i-th iteration statistics of the run (both
are recorded once per dispatched step, in order): decode-only steps (no context request) are
the ones MBU and FLOP utilisation are computed on, with T = the step's generation requests and
C = its KV blocks in use x tokens per block (page granularity: at most one partly filled page
per sequence is counted whole).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from jaxllm.bench.gpu.step_roofline import StepRoofline, utilisation

# `EngineTiming` fields read as deltas over the timed run (a field the engine does not have
# yet reads as None, and its columns print '-').
TIMING_FIELDS = (
    "steps",
    "host_seconds",
    "host_cpu_seconds",
    "host_wall_seconds",
    "blocking_reads",
    "blocking_read_seconds",
    "dispatch_seconds",
    "dispatch_wait_seconds",
)


def timing_snapshot(timing: Any) -> dict[str, Optional[float]]:
    return {name: getattr(timing, name, None) for name in TIMING_FIELDS}


def per_step_host(before: dict[str, Optional[float]], after: dict[str, Optional[float]]) -> dict[str, Any]:
    """Host columns per step: ms of CPU time, of wall time outside device waits, of dispatch,
    blocking device reads (count and ms)."""
    delta = {
        k: (after[k] - before[k]) if after[k] is not None and before[k] is not None else None for k in TIMING_FIELDS
    }
    steps = int(delta["steps"] or 0)

    def per_step(name: str, scale: float = 1e3) -> Optional[float]:
        value = delta[name]
        return None if value is None or steps == 0 else scale * value / steps

    return dict(
        steps=steps,
        host_ms=per_step("host_seconds"),
        host_cpu_ms=per_step("host_cpu_seconds"),
        host_wall_ms=per_step("host_wall_seconds"),
        blocking_reads=per_step("blocking_reads", 1.0),
        blocking_read_ms=per_step("blocking_read_seconds"),
        dispatch_ms=per_step("dispatch_seconds"),
        dispatch_wait_ms=per_step("dispatch_wait_seconds"),
    )


def device_busy(enqueued: Sequence[float], finished: Sequence[float]) -> list[float]:
    """Seconds the device worked on each step (see the module docstring)."""
    busy = []
    for i in range(min(len(enqueued), len(finished))):
        start = enqueued[i] if i == 0 else max(enqueued[i], finished[i - 1])
        busy.append(max(0.0, finished[i] - start))
    return busy


def device_idle(enqueued: Sequence[float], finished: Sequence[float]) -> list[float]:
    """Seconds the device waited before each step after the first."""
    return [max(0.0, enqueued[i] - finished[i - 1]) for i in range(1, min(len(enqueued), len(finished) + 1))]


def per_step_device(enqueued: Sequence[float], finished: Sequence[float], wall_s: float) -> dict[str, Any]:
    busy, idle = device_busy(enqueued, finished), device_idle(enqueued, finished)
    return dict(
        device_ms=1e3 * sum(busy) / len(busy) if busy else None,
        idle_ms=1e3 * sum(idle) / len(idle) if idle else None,
        idle_share=sum(idle) / wall_s if wall_s > 0 and idle else None,
    )


def decode_steps(stats: Sequence[dict], busy: Sequence[float]) -> list[tuple[int, int, float]]:
    """(generation rows, KV tokens in use, busy seconds) of each decode-only step."""
    out = []
    for s, seconds in zip(stats, busy):
        batch = s.get("inflightBatchingStats", {})
        kv = s.get("kvCacheStats", {})
        if batch.get("numContextRequests", 1) == 0 and batch.get("numGenRequests", 0) > 0:
            out.append((int(batch["numGenRequests"]), int(kv["usedNumBlocks"]) * int(kv["tokensPerBlock"]), seconds))
    return out


def decode_utilisation(
    steps: Sequence[tuple[int, int, float]], roof: StepRoofline, copy_bytes_per_s: float, matmul_flops_per_s: float
) -> dict[str, Any]:
    """Over the decode-only steps: mean device ms, rows, GB a step must read, MBU, FLOP utilisation."""
    if not steps:
        return dict(decode_steps=0, decode_device_ms=None, decode_rows=None, step_gb=None, mbu=None, flop_util=None)
    seconds = sum(s for _, _, s in steps)
    nbytes = sum(roof.decode_bytes(t, c) for t, c, _ in steps)
    flops = sum(roof.decode_flops(t, c) for t, c, _ in steps)
    return dict(
        decode_steps=len(steps),
        decode_device_ms=1e3 * seconds / len(steps),
        decode_rows=sum(t for t, _, _ in steps) / len(steps),
        step_gb=nbytes / len(steps) / 1e9,
        mbu=utilisation(nbytes, seconds, copy_bytes_per_s),
        flop_util=utilisation(flops, seconds, matmul_flops_per_s),
    )
