"""The persistent compilation cache: a second process that builds an engine with the same
model and limits compiles nothing (counted with jax.monitoring, not timed), and the
switches that turn it off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxllm.cli import build_parser, engine_kwargs
from jaxllm.engine.compile_cache import compile_cache_requested
from jaxllm.models import materialize_preset

ROOT = Path(__file__).resolve().parents[1]

# Builds a tiny engine, warms it up (one token bucket + the greedy sampler) and runs one
# request; prints how many programs XLA really compiled and how many came from the cache.
# JAX reports a cache hit through its compile path too, so compiles = events - hits.
ENGINE_RUN = """
import json, sys
import jax
events = {"compile": 0, "hit": 0}
def on_duration(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        events["compile"] += 1
def on_event(event, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
        events["hit"] += 1
jax.monitoring.register_event_duration_secs_listener(on_duration)
jax.monitoring.register_event_listener(on_event)
from jaxllm.config import KvCacheConfig
from jaxllm.engine.config import EngineConfig
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.sampling import SamplingParams
engine = LLMEngine(EngineConfig(model=sys.argv[1], max_batch_size=2, max_num_tokens=16, max_seq_len=64,
                                kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=256)))
engine.warmup(all_variants=False)
engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True))
while engine.has_unfinished_requests():
    engine.step()
print(json.dumps({"compiles": events["compile"] - events["hit"], "hits": events["hit"],
                  "cache_dir": jax.config.jax_compilation_cache_dir}))
"""


def run_engine_process(model_dir: Path, cache_root: Path, **env_overrides: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "JAXLLM_COMPILE_CACHE"))}
    env.update(JAXLLM_CACHE_DIR=str(cache_root), JAX_PLATFORMS="cpu", **env_overrides)
    proc = subprocess.run([sys.executable, "-c", ENGINE_RUN, str(model_dir)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_with_the_same_engine_compiles_nothing(tmp_path):
    model_dir = materialize_preset("tiny-dense")
    first = run_engine_process(model_dir, tmp_path)
    cache_dir = Path(first["cache_dir"])
    assert cache_dir.parent == tmp_path / "xla"  # $JAXLLM_CACHE_DIR/xla/<host>
    assert first["compiles"] > 0
    entries = list(cache_dir.iterdir())
    assert len(entries) >= first["compiles"] - 1  # every program is kept, however small or fast
    second = run_engine_process(model_dir, tmp_path)
    assert second["compiles"] == 0, second
    assert second["hits"] >= first["compiles"]

    off = run_engine_process(model_dir, tmp_path / "off", JAXLLM_COMPILE_CACHE="0")
    assert off["hits"] == 0 and off["compiles"] > 0 and not off["cache_dir"]
    assert not (tmp_path / "off" / "xla").exists()


def test_switches_turn_the_cache_off(monkeypatch):
    assert compile_cache_requested(True) and not compile_cache_requested(False)
    for value in ("0", "false", "OFF"):
        monkeypatch.setenv("JAXLLM_COMPILE_CACHE", value)
        assert not compile_cache_requested(True)
    monkeypatch.delenv("JAXLLM_COMPILE_CACHE")
    assert "compile_cache" not in engine_kwargs(build_parser().parse_args(["generate"]))
    assert engine_kwargs(build_parser().parse_args(["generate", "--no-compile-cache"]))["compile_cache"] is False
