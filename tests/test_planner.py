"""The step split: the planner runs on the host alone; the runner reproduces a run's tokens
from its recorded plans."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def plan_without_devices() -> dict:
    """Subprocess entry point: plan a workload with host-made tokens, never starting a backend."""
    from jax._src import xla_bridge

    from jaxllm.engine.planner import PLACEHOLDER_TOKEN, Planner, StepPlan
    from jaxllm.kv_cache import KVCacheManager
    from jaxllm.llm_args import SchedulerConfig
    from jaxllm.llm_request import LlmRequest
    from jaxllm.sampling import SamplingParams
    from jaxllm.scheduler import make_scheduler

    kv = KVCacheManager(64, 8, 12, enable_block_reuse=True, max_num_sequences=4)
    planner = Planner(
        scheduler=make_scheduler(SchedulerConfig(), kv, 4, 32, True),
        kv_cache_manager=kv,
        max_batch_size=4,
        max_num_tokens=32,
        min_token_bucket=16,
        max_blocks_per_seq=12,
        max_seq_len=96,
    )
    rng = np.random.default_rng(0)
    shared = [int(t) for t in rng.integers(3, 200, 16)]
    requests = [
        LlmRequest(
            i,
            shared + [int(t) for t in rng.integers(3, 200, n)],
            6,
            sampling_params=SamplingParams(max_tokens=6, ignore_eos=True),
            seed=i,
        )
        for i, n in enumerate((30, 3, 12))
    ]
    active, steps, only_host_values, buckets = list(requests), 0, True, set()
    while active:
        step = planner.plan(active)
        steps += 1
        plan = step.plan
        buckets.add(plan.batch.num_tokens_padded)
        for name in ("batch", "sampling"):
            for f in fields(getattr(plan, name)):
                value = getattr(getattr(plan, name), f.name)
                only_host_values &= value is None or isinstance(
                    value, (np.ndarray, bool, int)
                )  # None: unused (LoRA off)
        only_host_values &= isinstance(plan, StepPlan) and isinstance(plan.feed_index, np.ndarray)
        for request, _row, index in step.entries:  # the "device": a token made up on the host
            assert request.output_token_ids[index] == PLACEHOLDER_TOKEN
            request.output_token_ids[index] = 3 + (request.request_id * 7 + index) % 100
            if len(request.output_token_ids) >= 6:
                request.finish("length")
                kv.free_resources(request)
        active = [r for r in active if not r.is_finished]
        assert steps < 100
    return dict(
        steps=steps,
        backends_started=xla_bridge.backends_are_initialized(),
        only_host=only_host_values,
        buckets=sorted(buckets),
        reused=kv.get_kv_cache_stats().reused_blocks,
        outputs=[r.output_token_ids for r in requests],
    )


def test_planner_runs_without_devices():
    code = (
        f"import sys, json; sys.path.insert(0, {str(ROOT)!r}); from tests.test_planner import "
        f"plan_without_devices; print(json.dumps(plan_without_devices()))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result["backends_started"], "planning started a jax backend"
    assert result["only_host"], "a plan holds something other than numpy arrays and scalars"
    assert result["steps"] > 6 and result["buckets"] == [16, 32]  # chunked prefill, then decode
    assert all(len(o) == 6 and -1 not in o for o in result["outputs"])


def test_runner_reproduces_tokens_from_recorded_plans(tmp_path):
    from jaxllm import KvCacheConfig, SamplingParams
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine
    from jaxllm.engine.model_runner import ModelRunner
    from jaxllm.models import materialize_preset
    from tests.parallel_workload import record_plans
    from tests.test_engine_tp import write_checkpoint_vocab
    from tests.test_sharding_tp import hf_config

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(hf_config("qwen3_moe"), vocab_size=256)))
    write_checkpoint_vocab("qwen3_moe", model)
    engine = LLMEngine(
        EngineConfig(
            model=str(model),
            tokenizer=str(materialize_preset("tiny-moe")),
            dtype="float32",
            max_batch_size=4,
            max_num_tokens=32,
            max_seq_len=128,
            kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=512),
        )
    )
    recorded = record_plans(engine)
    rng = np.random.default_rng(1)
    shared = [int(t) for t in rng.integers(3, 250, 20)]
    arrivals = {0: [shared + [5, 6, 7], [int(t) for t in rng.integers(3, 250, 40)]], 3: [shared + [9]]}
    params = [SamplingParams(max_tokens=6, ignore_eos=True), SamplingParams(max_tokens=6, temperature=0.8, seed=3)]
    step = 0
    while step in arrivals or engine.has_unfinished_requests() or step < max(arrivals):
        for i, p in enumerate(arrivals.get(step, [])):
            engine.add_request(p, params[i % 2])
        engine.step()
        step += 1
    assert len(recorded) > 5 and any((plan.feed_index >= 0).any() for plan, _ in recorded)  # overlap feeding

    replay = ModelRunner(
        model_config=engine.model_config,
        params=engine.runner.params,
        num_blocks=engine.kv_cache_manager.num_blocks,
        tokens_per_block=8,
        kv_dtype=engine.model_config.dtype,
        attention_fn=engine.runner.attention_fn,
        moe_fn=engine.runner.moe_fn,
        max_batch_size=4,
    )
    for plan, out in recorded:
        again = replay.execute(plan)
        assert np.array_equal(np.asarray(again.sampled.token_ids), np.asarray(out.sampled.token_ids))


def _drive_planner(steady: bool, overlap: bool) -> tuple[list, int]:
    """Plan a workload the way the engine's loop does (with `overlap` a step's tokens are
    filled in after the next step is planned; requests finish by length or a stop token, new
    ones arrive), with the built-in scheduler (`steady`) or the same scheduler under another
    class, which the planner does not trust to keep a decode batch (the general path)."""
    from jaxllm.engine.planner import Planner
    from jaxllm.kv_cache import KVCacheManager
    from jaxllm.llm_args import SchedulerConfig
    from jaxllm.llm_request import LlmRequest
    from jaxllm.sampling import SamplingParams
    from jaxllm.scheduler import make_scheduler
    from jaxllm.scheduler.simple import SimpleScheduler

    class GeneralScheduler(SimpleScheduler):
        pass

    kv = KVCacheManager(160, 4, 16, enable_block_reuse=True, max_num_sequences=6)
    scheduler = make_scheduler(SchedulerConfig(), kv, 6, 64, True)
    if not steady:
        scheduler = GeneralScheduler(scheduler.capacity_scheduler, scheduler.micro_batch_scheduler)
    planner = Planner(
        scheduler=scheduler,
        kv_cache_manager=kv,
        max_batch_size=6,
        max_num_tokens=64,
        min_token_bucket=16,
        max_blocks_per_seq=16,
        max_seq_len=64,
    )
    rng = np.random.default_rng(7)
    shared = [int(t) for t in rng.integers(3, 200, 9)]
    settings = [
        dict(),
        dict(temperature=0.8, seed=1),
        dict(temperature=1.0, top_k=5, seed=4),
        dict(repetition_penalty=1.3),
    ]
    arrivals = {0: 4, 1: 1, 14: 2, 15: 1, 30: 3, 52: 1}
    active: list = []
    pending: list = []
    records: list = []
    decode_steps = 0
    next_id = 0
    for step in range(90):
        for _ in range(arrivals.get(step, 0)):
            prompt = (shared if next_id % 2 else []) + [int(t) for t in rng.integers(3, 200, int(rng.integers(2, 11)))]
            params = SamplingParams(max_tokens=int(rng.integers(6, 30)), **settings[next_id % len(settings)])
            request = LlmRequest(
                next_id, prompt, params.max_tokens, arrival_time=float(next_id), sampling_params=params
            )
            request.seed, request.end_ids = 1000 + next_id, (2,)  # as resolve_seed would, fixed
            active.append(request)
            next_id += 1
        if not overlap:
            active, pending = _read_back(kv, active, pending), []
        candidates = [r for r in active if len(r.output_token_ids) < r.max_new_tokens]
        output = planner.schedule(candidates) if candidates else None
        entries = []
        if output is not None:
            decode_steps += output.kv_placement.decode is not None
            plan = planner.build(output, pending or None)
            entries = planner.commit(output)
            records.append(
                (
                    plan,
                    [(r.request_id, row, index) for r, row, index in entries],
                    {r.request_id: kv.get_block_ids(r) for r in active},
                )
            )
        active, pending = _read_back(kv, active, pending), entries
        kv.check_invariants()
    assert not _read_back(kv, active, pending)
    stats = kv.get_kv_cache_stats()
    records.append((stats.reused_blocks, stats.alloc_total_blocks))
    return records, decode_steps


def _read_back(kv, active: list, pending: list) -> list:
    """The "device": made-up tokens for a step's entries; finished requests are freed."""
    from jaxllm.engine.planner import PLACEHOLDER_TOKEN

    for request, _row, index in pending:
        if request.is_finished:
            continue
        token = 2 if (request.request_id * 31 + index) % 17 == 0 else 3 + (request.request_id * 7 + index) % 150
        request.output_token_ids[index] = token
        if token == 2 or index + 1 >= request.max_new_tokens:
            del request.output_token_ids[index + 1 :]
            assert PLACEHOLDER_TOKEN not in request.output_token_ids
            request.finish("stop")
            kv.free_resources(request)
    return [r for r in active if not r.is_finished]


def test_steady_decode_steps_plan_what_the_general_path_plans():
    """A decode batch that stays the same is planned from per-slot arrays (no scheduler
    pass, blocks prepared per block boundary, sampling rows gathered); every step's plan,
    token entries, block tables and prefix-cache counts equal the general path's."""
    for overlap in (True, False):
        steady, decode_steps = _drive_planner(steady=True, overlap=overlap)
        general, general_decode_steps = _drive_planner(steady=False, overlap=overlap)
        assert general_decode_steps == 0 and decode_steps > 20
        _assert_same_records(steady, general)


def _assert_same_records(steady: list, general: list) -> None:
    assert len(steady) == len(general)
    for i, (a, b) in enumerate(zip(steady[:-1], general[:-1])):
        plan_a, plan_b = a[0], b[0]
        for name in ("batch", "sampling"):
            for f in fields(getattr(plan_a, name)):
                x, y = getattr(getattr(plan_a, name), f.name), getattr(getattr(plan_b, name), f.name)
                if isinstance(x, np.ndarray):
                    assert x.dtype == y.dtype and np.array_equal(x, y), (i, name, f.name)
                else:
                    assert x == y, (i, name, f.name)
        assert np.array_equal(plan_a.feed_index, plan_b.feed_index), i
        assert (plan_a.num_tokens, plan_a.num_context_tokens) == (plan_b.num_tokens, plan_b.num_context_tokens), i
        assert a[1:] == b[1:], i
    assert steady[-1] == general[-1]
