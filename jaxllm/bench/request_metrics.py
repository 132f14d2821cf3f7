"""Request timing records and the summary every benchmark reports (trtllm-bench / benchmark_serving).

Per request: TTFT = first token - start; E2E = end - start; TPOT = (E2E - TTFT) /
(output tokens - 1); ITL = the gaps between streamed chunks. Totals over the wall time
T (first start to last end): requests / T, output tokens / T, (input + output) / T.
Each latency gets mean, min, max and p50 / p90 / p95 / p99.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    """Timestamps (time.perf_counter seconds) of one benchmarked request."""

    input_tokens: int
    start: float
    output_tokens: int = 0
    first_token: Optional[float] = None
    end: Optional[float] = None
    chunk_times: list[float] = field(default_factory=list)
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def e2e(self) -> Optional[float]:
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> Optional[float]:
        if self.first_token is None or self.end is None or self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def distribution(values: Sequence[float], scale: float = 1e3) -> dict[str, Optional[float]]:
    """mean / min / max / pXX of `values` (seconds) in milliseconds; None when there are none."""
    if len(values) == 0:
        return {"mean": None, "min": None, "max": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=np.float64) * scale
    out = {"mean": float(arr.mean()), "min": float(arr.min()), "max": float(arr.max())}
    for p, v in zip(PERCENTILES, np.percentile(arr, PERCENTILES)):
        out[f"p{p}"] = float(v)
    return out


def summarize(
    records: Sequence[RequestRecord],
    *,
    wall_time: Optional[float] = None,
    slo_ttft_ms: Optional[float] = None,
    slo_tpot_ms: Optional[float] = None,
) -> dict[str, Any]:
    """The report of one run. `wall_time` defaults to first start .. last end of the records."""
    done = [r for r in records if r.ok]
    if wall_time is None:
        wall_time = (max(r.end for r in done) - min(r.start for r in done)) if done else 0.0
    total_in = sum(r.input_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    per_s = (lambda x: x / wall_time) if wall_time > 0 else (lambda x: 0.0)
    summary: dict[str, Any] = {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_failed": len(records) - len(done),
        "duration_s": wall_time,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(done)),
        "output_token_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "ttft_ms": distribution([r.ttft for r in done if r.ttft is not None]),
        "tpot_ms": distribution([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": distribution([gap for r in done for gap in r.itl]),
        "e2e_latency_ms": distribution([r.e2e for r in done]),
    }
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = [
            r
            for r in done
            if (slo_ttft_ms is None or (r.ttft is not None and r.ttft * 1e3 <= slo_ttft_ms))
            and (slo_tpot_ms is None or r.tpot is None or r.tpot * 1e3 <= slo_tpot_ms)
        ]
        summary["goodput"] = {
            "slo_ttft_ms": slo_ttft_ms,
            "slo_tpot_ms": slo_tpot_ms,
            "fraction": len(good) / len(records) if records else 0.0,
            "request_throughput": per_s(len(good)),
        }
    errors = sorted({r.error for r in records if r.error})
    if errors:
        summary["errors"] = errors[:10]
    return summary


def _fmt(v: Optional[float], digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:,.{digits}f}"


def format_table(summary: dict[str, Any], title: str = "benchmark") -> str:
    """A plain-text report: totals, then one row per latency metric."""
    lines = [
        f"==== {title} ====",
        f"requests            {summary['num_completed']}/{summary['num_requests']} completed"
        + (f" ({summary['num_failed']} failed)" if summary["num_failed"] else ""),
        f"duration            {_fmt(summary['duration_s'], 3)} s",
        f"input tokens        {summary['total_input_tokens']:,}",
        f"output tokens       {summary['total_output_tokens']:,}",
        f"request throughput  {_fmt(summary['request_throughput'])} req/s",
        f"output throughput   {_fmt(summary['output_token_throughput'])} tok/s",
        f"total throughput    {_fmt(summary['total_token_throughput'])} tok/s",
    ]
    if "goodput" in summary:
        g = summary["goodput"]
        lines.append(
            f"goodput             {_fmt(g['request_throughput'])} req/s ({_fmt(100 * g['fraction'], 1)}% within SLO)"
        )
    cols = ["mean", "min", "p50", "p90", "p95", "p99", "max"]
    lines.append("")
    lines.append(f"{'metric (ms)':<14}" + "".join(f"{c:>11}" for c in cols))
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_latency_ms", "E2E")):
        dist = summary[key]
        lines.append(f"{label:<14}" + "".join(f"{_fmt(dist[c]):>11}" for c in cols))
    for key, value in summary.get("extra", {}).items():
        lines.append(f"{key:<32}{value}")
    if summary.get("errors"):
        lines.append("errors: " + "; ".join(summary["errors"]))
    return "\n".join(lines)


def write_report(path: Union[str, Path], summary: dict[str, Any], config: Optional[dict] = None) -> None:
    report = dict(summary)
    if config is not None:
        report["config"] = config
    Path(path).write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")


@contextlib.contextmanager
def counting_compiles() -> Iterator[list[str]]:
    """Collects one entry per XLA backend compile while the block runs (benchmarks report the
    compiles that happened after warm-up; the engine should have none)."""
    import jax.monitoring

    compiles: list[str] = []

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event.endswith("backend_compile_duration"):
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
