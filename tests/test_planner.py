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

    from jaxllm.config import SchedulerConfig
    from jaxllm.engine.planner import PLACEHOLDER_TOKEN, Planner, StepPlan
    from jaxllm.kv_cache import KVCacheManager
    from jaxllm.request import LlmRequest
    from jaxllm.sampling import SamplingParams
    from jaxllm.scheduler import make_scheduler

    kv = KVCacheManager(64, 8, 12, enable_block_reuse=True, max_num_sequences=4)
    planner = Planner(scheduler=make_scheduler(SchedulerConfig(), kv, 4, 32, True), kv_cache_manager=kv,
                      max_batch_size=4, max_num_tokens=32, min_token_bucket=16, max_blocks_per_seq=12,
                      max_seq_len=96)
    rng = np.random.default_rng(0)
    shared = [int(t) for t in rng.integers(3, 200, 16)]
    requests = [LlmRequest(i, shared + [int(t) for t in rng.integers(3, 200, n)], 6,
                           sampling_params=SamplingParams(max_tokens=6, ignore_eos=True), seed=i)
                for i, n in enumerate((30, 3, 12))]
    active, steps, only_host_values, buckets = list(requests), 0, True, set()
    while active:
        step = planner.plan(active)
        steps += 1
        plan = step.plan
        buckets.add(plan.batch.num_tokens_padded)
        for name in ("batch", "sampling"):
            for f in fields(getattr(plan, name)):
                value = getattr(getattr(plan, name), f.name)
                only_host_values &= value is None or isinstance(value, (np.ndarray, bool, int))  # None: unused (LoRA off)
        only_host_values &= isinstance(plan, StepPlan) and isinstance(plan.feed_index, np.ndarray)
        for request, row, index in step.entries:  # the "device": a token made up on the host
            assert request.output_token_ids[index] == PLACEHOLDER_TOKEN
            request.output_token_ids[index] = 3 + (request.request_id * 7 + index) % 100
            if len(request.output_token_ids) >= 6:
                request.finish("length")
                kv.free_resources(request)
        active = [r for r in active if not r.is_finished]
        assert steps < 100
    return dict(steps=steps, backends_started=xla_bridge.backends_are_initialized(), only_host=only_host_values,
                buckets=sorted(buckets), reused=kv.get_kv_cache_stats().reused_blocks,
                outputs=[r.output_token_ids for r in requests])


def test_planner_runs_without_devices():
    code = f"import sys, json; sys.path.insert(0, {str(ROOT)!r}); from tests.test_planner import " \
           f"plan_without_devices; print(json.dumps(plan_without_devices()))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result["backends_started"], "planning started a jax backend"
    assert result["only_host"], "a plan holds something other than numpy arrays and scalars"
    assert result["steps"] > 6 and result["buckets"] == [16, 32]  # chunked prefill, then decode
    assert all(len(o) == 6 and -1 not in o for o in result["outputs"])


def test_runner_reproduces_tokens_from_recorded_plans(tmp_path):
    from jaxllm import KvCacheConfig, SamplingParams
    from jaxllm.engine.config import EngineConfig
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
    engine = LLMEngine(EngineConfig(model=str(model), tokenizer=str(materialize_preset("tiny-moe")),
                                    dtype="float32", max_batch_size=4,
                                    max_num_tokens=32, max_seq_len=128,
                                    kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=512)))
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

    replay = ModelRunner(model_config=engine.model_config, params=engine.runner.params,
                         num_blocks=engine.kv_cache_manager.num_blocks, tokens_per_block=8,
                         kv_dtype=engine.model_config.dtype, attention_fn=engine.runner.attention_fn,
                         moe_fn=engine.runner.moe_fn, max_batch_size=4)
    for plan, out in recorded:
        again = replay.execute(plan)
        assert np.array_equal(np.asarray(again.token_ids), np.asarray(out.token_ids))
