"""Section 4: the engine users get, end to end, on full-size random-weight models in bf16, with
the Pallas backends (what `auto` picks on a GPU) and with the XLA fallback.

Models, limits and the time estimate are in `engine_plan`. For each model and backend one
`LLMEngine` is built normally from a directory holding config.json and a tokenizer, its
weights drawn on the device (`load_format="dummy"`), warmed up (every bucket compiled, greedy
sampler), and driven on this thread (requests admitted up to the concurrency, EOS ignored,
greedy) at each concurrency with one request per slot. Reported per run: output tokens/s,
TTFT, inter-token latency, compiles during the run; per step (`engine_steps`): host CPU ms,
host wall ms outside device waits, dispatch ms, blocking device reads, device busy ms, device
idle ms and its share of the run, and on the decode-only steps the device ms, the GB a step
must read, MBU and FLOP utilisation (`step_roofline`). Per build: weight-drawing and warm-up
time, when each compiled program became ready, weight and KV bytes next to device memory in
use. A goals table closes the section (decode MBU and inter-token latency at concurrency 1,
idle share and host against device time at concurrency 256).

Time: each model gets an equal share of what is left; the Pallas build runs first, then the
XLA one. A case runs only when its estimate (the previous case's measured time scaled by the
plan's estimate, `engine_plan.estimate_s`) fits twice its share of the time left, and it is
cut at its share (the row says so; its per-step numbers cover the steps that ran).

The dry run: one tiny MoE model, both backends (Pallas in interpret mode), tiny shapes.
"""

from __future__ import annotations

import functools
import gc
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np

from jaxllm.bench.dataset import BenchRequest
from jaxllm.bench.gpu import engine_steps
from jaxllm.bench.gpu.engine_plan import EngineModel, EnginePlan, estimate_s, plan
from jaxllm.bench.gpu.environment import ceilings_of
from jaxllm.bench.gpu.report import OutOfTime, SectionContext, Table
from jaxllm.bench.gpu.step_roofline import step_roofline
from jaxllm.bench.host_overhead import DeviceWatcher
from jaxllm.bench.kernel_timing import Ceilings
from jaxllm.bench.request_metrics import RequestRecord, counting_compiles, summarize
from jaxllm.bench.throughput import request_params
from jaxllm.models.presets import materialize_preset

BUILD_COLUMNS = (
    "estimate_s",
    "load_s",
    "warmup_s",
    "programs",
    "mean_compile_s",
    "ready_at_s",
    "weights_gb",
    "kv_cache_gb",
    "in_use_after_build_gb",
)
RUN_COLUMNS = (
    "concurrency",
    "estimate_s",
    "seconds",
    "output_tok_s",
    "ttft_ms_p50",
    "ttft_ms_p90",
    "itl_ms_p50",
    "itl_ms_p90",
    "compiles",
    "peak_gb",
    "note",
)
STEP_COLUMNS = (
    "concurrency",
    "steps",
    "host_cpu_ms",
    "host_wall_ms",
    "dispatch_ms",
    "blocking_reads",
    "device_ms",
    "idle_ms",
    "idle_pct",
    "decode_device_ms",
    "decode_rows",
    "step_gb",
    "mbu_pct",
    "flop_util_pct",
)
GOAL_COLUMNS = ("model", "backend", "goal", "target", "value", "met")
MBU_GOAL = 0.8  # decode at concurrency 1: share of the bandwidth bound
IDLE_GOAL = 0.05  # concurrency 256: device idle share of the run


def _gb(n: Any) -> Any:
    return None if n is None else n / 1e9


def _pct(x: Any) -> Any:
    return None if x is None else 100.0 * x


def _tree_bytes(tree: Any) -> int:
    return int(sum(getattr(leaf, "nbytes", 0) for leaf in jax.tree_util.tree_leaves(tree)))


def _memory() -> dict[str, Any]:
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - CPU devices may report nothing
        stats = {}
    return {k: stats.get(k) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}


def write_config_dir(directory: Path, model: EngineModel) -> Path:
    """config.json and the tiny presets' tokenizer: all a dummy-weights engine reads."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = materialize_preset("tiny-dense")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)
    (directory / "config.json").write_text(json.dumps(model.hf_config, indent=1, sort_keys=True))
    return directory


def _requests(count: int, input_len: int, output_len: int, vocab: int, seed: int) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    return [
        BenchRequest(
            task_id=i, output_tokens=output_len, input_ids=rng.integers(3, min(vocab, 1000), input_len).tolist()
        )
        for i in range(count)
    ]


def build_engine(model_dir: Path, backend: str, p: EnginePlan) -> tuple[Any, dict[str, Any]]:
    """(the warmed-up engine, build facts: seconds, compile times, bytes)."""
    from jaxllm import KvCacheConfig
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=str(model_dir),
        dtype="bfloat16",
        load_format="dummy",
        max_batch_size=p.max_batch_size,
        max_num_tokens=p.max_num_tokens,
        min_token_bucket=p.min_token_bucket,
        decode_batch_sizes=list(p.decode_batch_sizes),
        max_seq_len=p.max_seq_len,
        attention_backend=backend,
        moe_backend=backend,
        compile_cache=False,
        kv_cache_config=KvCacheConfig(
            tokens_per_block=p.tokens_per_block, max_tokens=p.max_batch_size * p.max_seq_len, enable_block_reuse=False
        ),
    )
    start = time.perf_counter()
    engine = LLMEngine(config)
    jax.block_until_ready(engine.runner.params)
    load_s = time.perf_counter() - start
    ready: list[float] = []
    warm_start = time.perf_counter()
    engine.warmup(all_variants=False, progress=lambda done, total: ready.append(time.perf_counter() - warm_start))
    runner = engine.runner
    facts = dict(
        load_s=load_s,
        warmup_s=time.perf_counter() - warm_start,
        token_buckets=engine.token_buckets(),
        ready_at_s=[round(t, 2) for t in ready],
        programs=runner.num_compiled_variants,
        mean_compile_s=runner.compile_seconds / max(1, runner.num_compiled_variants),
        weight_bytes=_tree_bytes(runner.params),
        kv_cache_bytes=_tree_bytes(runner.kv_cache),
        attention_backend=engine.attention_backend,
        moe_backend=engine.moe_backend,
        memory_after_build=_memory(),
    )
    return engine, facts


def drive(engine: Any, requests: list[BenchRequest], concurrency: int, deadline: float) -> tuple[list, bool]:
    """`jaxllm.bench.throughput.run_engine` with a deadline: (records, whether it was cut). A cut
    run's unfinished requests are aborted, so the engine is empty for the next run."""
    pending = list(enumerate(requests))[::-1]
    records: dict[int, RequestRecord] = {}
    by_rid: dict[int, int] = {}
    in_flight = 0
    cut = False
    while pending or in_flight:
        if time.monotonic() > deadline:
            cut = True
            break
        while pending and in_flight < concurrency:
            i, request = pending.pop()
            records[i] = RequestRecord(input_tokens=len(request.input_ids), start=time.perf_counter())
            by_rid[engine.add_request(request.input_ids, request_params(request, False)).request_id] = i
            in_flight += 1
        updates = engine.step()
        now = time.perf_counter()
        for u in updates:
            i = by_rid.get(u.request.request_id)
            if i is None:
                continue
            record = records[i]
            if u.new_token_ids:
                record.output_tokens += len(u.new_token_ids)
                record.chunk_times.append(now)
                if record.first_token is None:
                    record.first_token = now
            if u.finished:
                record.end = now
                in_flight -= 1
    if cut:
        for rid, i in by_rid.items():
            if records[i].end is None:
                engine.abort_request(rid)
        for _ in range(8):
            if not engine.has_unfinished_requests():
                break
            engine.step()
    return [records[i] for i in sorted(records)], cut


def measure(
    engine: Any, concurrency: int, p: EnginePlan, roof: Any, ceil: Ceilings, deadline: float, seed: int
) -> dict[str, Any]:
    """One timed run: request metrics, per-step host and device numbers, decode utilisation."""
    requests = _requests(concurrency, p.input_len, p.output_len, engine.model_config.vocab_size, seed)
    before, first_iteration = engine_steps.timing_snapshot(engine.timing), engine.iteration
    watcher = DeviceWatcher()
    engine.on_dispatch = watcher
    try:
        with counting_compiles() as compiles:
            start = time.perf_counter()
            records, cut = drive(engine, requests, concurrency, deadline)
            wall = time.perf_counter() - start
    finally:
        engine.on_dispatch = None
        watcher.close()
    host = engine_steps.per_step_host(before, engine_steps.timing_snapshot(engine.timing))
    stats = [s for s in engine.iteration_stats if s["iter"] > first_iteration]
    busy = engine_steps.device_busy(watcher.enqueued, watcher.finished)
    aligned = len(stats) == len(watcher.enqueued)
    decode = engine_steps.decode_utilisation(
        engine_steps.decode_steps(stats, busy) if aligned else [], roof, ceil.bytes_per_s, ceil.flops_per_s
    )
    summary = summarize(records, wall_time=wall)
    produced = sum(r.output_tokens for r in records)
    notes = []
    if cut:
        notes.append(f"cut at its time share: {sum(r.end is not None for r in records)}/{len(records)} done")
    if not aligned:
        notes.append(f"{len(stats)} step statistics for {len(watcher.enqueued)} steps: no decode columns")
    return dict(
        concurrency=concurrency,
        requests=len(records),
        failed=0 if cut else summary["num_failed"],
        cut=cut,
        seconds=wall,
        output_tok_s=produced / wall if wall else None,
        ttft_ms_p50=summary["ttft_ms"]["p50"],
        ttft_ms_p90=summary["ttft_ms"]["p90"],
        itl_ms_p50=summary["itl_ms"]["p50"],
        itl_ms_p90=summary["itl_ms"]["p90"],
        compiles_during_run=len(compiles),
        memory=_memory(),
        note="; ".join(notes),
        **host,
        **engine_steps.per_step_device(watcher.enqueued, watcher.finished, wall),
        **decode,
    )


def run_backend(
    ctx: SectionContext, model: EngineModel, backend: str, p: EnginePlan, model_dir: Path, ceil: Ceilings
) -> None:
    roof = step_roofline(model.config(), "bfloat16")
    estimate = estimate_s(model, backend, p, ceil.bytes_per_s, ceil.flops_per_s)
    engine, facts = build_engine(model_dir, backend, p)
    label = f"{model.name}, {backend} backends (attention {facts['attention_backend']}, MoE {facts['moe_backend']})"
    step_rows: list[dict[str, Any]] = []  # printed as a table after the runs (tables print as they grow)
    try:
        ctx.data.setdefault("builds", []).append(dict(model=model.name, backend=backend, **facts))
        ctx.table(f"{label}: build", BUILD_COLUMNS).add(
            estimate_s=estimate.build_s,
            load_s=facts["load_s"],
            warmup_s=facts["warmup_s"],
            programs=facts["programs"],
            mean_compile_s=facts["mean_compile_s"],
            ready_at_s=" ".join(map(str, facts["ready_at_s"])),
            weights_gb=_gb(facts["weight_bytes"]),
            kv_cache_gb=_gb(facts["kv_cache_bytes"]),
            in_use_after_build_gb=_gb(facts["memory_after_build"]["bytes_in_use"]),
        )
        runs: Table = ctx.table(f"{label}: runs ({p.input_len} in / {p.output_len} out tokens, greedy)", RUN_COLUMNS)
        scale: Optional[float] = None  # measured / estimated seconds of the last case that ran whole
        for i, concurrency in enumerate(p.concurrencies):
            ctx.check_time(f"{model.name} {backend} concurrency {concurrency}")
            share = ctx.time_left() / (len(p.concurrencies) - i)
            expected = estimate.run_s[concurrency] * (scale if scale is not None else 1.0)
            if scale is not None and expected > 2 * share:
                runs.add(concurrency=concurrency, estimate_s=expected, note=f"not run: {share:.0f} s share")
                continue
            row = measure(engine, concurrency, p, roof, ceil, time.monotonic() + share, seed=concurrency)
            if not row["cut"]:
                scale = row["seconds"] / max(1e-9, estimate.run_s[concurrency])
            ctx.data.setdefault("runs", []).append(dict(model=model.name, backend=backend, estimate_s=expected, **row))
            runs.add(
                **{
                    **{k: row.get(k) for k in RUN_COLUMNS},
                    "estimate_s": expected,
                    "compiles": row["compiles_during_run"],
                    "peak_gb": _gb(row["memory"]["peak_bytes_in_use"]),
                }
            )
            step_rows.append(
                {
                    **{k: row.get(k) for k in STEP_COLUMNS},
                    "idle_pct": _pct(row["idle_share"]),
                    "mbu_pct": _pct(row["mbu"]),
                    "flop_util_pct": _pct(row["flop_util"]),
                }
            )
    finally:
        if step_rows:
            steps = ctx.table(f"{label}: per step (decode columns: decode-only steps)", STEP_COLUMNS)
            for step_row in step_rows:
                steps.add(**step_row)
        engine.close()
        del engine
        gc.collect()  # the next engine's KV budget counts on this one's buffers being freed


def goal_rows(runs: list[dict[str, Any]], copy_bytes_per_s: float, bound_gb: dict[str, float]) -> list[dict]:
    """The engine goals per model and backend: MBU and inter-token latency at concurrency 1
    (the latency target is the bandwidth bound over the MBU goal), idle share and host CPU
    against device time per step at concurrency 256."""
    rows = []
    for r in runs:
        model, backend, c = r["model"], r["backend"], r["concurrency"]
        if c == 1 and r.get("mbu") is not None:
            rows.append(
                dict(goal="decode MBU, concurrency 1", target=f">= {100 * MBU_GOAL:.0f}%", value=_pct(r["mbu"]))
            )
            rows[-1].update(met=r["mbu"] >= MBU_GOAL, model=model, backend=backend)
            bound_ms = 1e3 * bound_gb[model] * 1e9 / copy_bytes_per_s
            target = bound_ms / MBU_GOAL
            rows.append(dict(goal="ITL p50 ms, concurrency 1", target=f"<= {target:.2f}", value=r["itl_ms_p50"]))
            rows[-1].update(met=r["itl_ms_p50"] is not None and r["itl_ms_p50"] <= target, model=model, backend=backend)
        if c == max(run["concurrency"] for run in runs) and c > 1:
            idle = r.get("idle_share")
            rows.append(
                dict(goal=f"device idle, concurrency {c}", target=f"<= {100 * IDLE_GOAL:.0f}%", value=_pct(idle))
            )
            rows[-1].update(met=None if idle is None else idle <= IDLE_GOAL, model=model, backend=backend)
            cpu, device = r.get("host_cpu_ms"), r.get("device_ms")
            rows.append(
                dict(
                    goal=f"host CPU ms per step, concurrency {c}", target=f"< device ms ({device and round(device, 2)})"
                )
            )
            rows[-1].update(
                value=cpu, met=None if cpu is None or device is None else cpu < device, model=model, backend=backend
            )
    return rows


def run(ctx: SectionContext) -> None:
    opts = ctx.options
    p = plan(opts.dry_run, opts.engine_models, opts.engine_backends)
    ceil = ceilings_of(ctx)
    ctx.data.update(
        input_len=p.input_len,
        output_len=p.output_len,
        max_num_tokens=p.max_num_tokens,
        min_token_bucket=p.min_token_bucket,
        decode_batch_sizes=list(p.decode_batch_sizes),
        tokens_per_block=p.tokens_per_block,
        concurrencies=list(p.concurrencies),
        copy_bytes_per_s=ceil.bytes_per_s,
        matmul_flops_per_s=ceil.flops_per_s,
        models={m.name: m.hf_config for m in p.models},
    )
    estimates = ctx.table(
        "Plan: estimated seconds (engine_plan.estimate_s; a rough roofline)",
        ("model", "backend", "build_s", *(f"c{c}_s" for c in p.concurrencies), "total_s"),
    )
    bound_gb: dict[str, float] = {}
    ran_out: list[str] = []
    for model in p.models:
        bound_gb[model.name] = step_roofline(model.config(), "bfloat16").decode_bytes(1, p.input_len) / 1e9
        for backend in p.backends:
            e = estimate_s(model, backend, p, ceil.bytes_per_s, ceil.flops_per_s)
            estimates.add(
                model=model.name,
                backend=backend,
                build_s=e.build_s,
                total_s=e.total_s,
                **{f"c{c}_s": e.run_s[c] for c in p.concurrencies},
            )
    try:
        with tempfile.TemporaryDirectory(prefix="jaxllm-bench-gpu-") as tmp:
            for i, model in enumerate(p.models):
                ctx.check_time(model.name)
                model_dir = write_config_dir(Path(tmp) / model.key, model)
                with ctx.share(1.0 / (len(p.models) - i)):
                    try:
                        for backend in p.backends:
                            ctx.check_time(f"{model.name} with {backend}")
                            ctx.run_case(
                                f"{model.name} with {backend}",
                                functools.partial(run_backend, ctx, model, backend, p, model_dir, ceil),
                            )
                    except OutOfTime as e:  # this model's share is used up; the next model has its own
                        ran_out.append(f"{model.name}: {e}")
                        ctx.note(ran_out[-1])
    finally:
        goals = ctx.table("Goals", GOAL_COLUMNS)
        for row in goal_rows(ctx.data.get("runs", []), ceil.bytes_per_s, bound_gb):
            goals.add(**row)
    if ran_out:  # the section's status says it did not run everything
        raise OutOfTime("; ".join(ran_out))
