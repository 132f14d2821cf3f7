"""The persistent compilation cache and the executable store beside it: a second process
that builds an engine with the same model and limits compiles nothing and traces none of the
stored programs (counted with jax.monitoring, not timed), gives the same tokens, on one device
and on a mesh of two; a changed configuration misses; a damaged entry is compiled again; and
the switches that turn both off."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxllm.cli import build_parser
from jaxllm.cli.args import engine_kwargs
from jaxllm.engine.compile_cache import compile_cache_requested
from jaxllm.models import materialize_preset
from tests.multidevice import FAST_COMPILE

ROOT = Path(__file__).resolve().parents[1]

# Builds tiny engines one after another (argv[2]: a JSON list of EngineConfig overrides, with
# "compile_only": compile the decode bucket's forward instead of warming up and generating, and
# "warmup": false: generate without warming up, compiling what the steps need);
# prints one JSON line per engine: how many programs XLA really compiled and how many came
# from JAX's cache (a hit goes through the compile path too, so compiles = events - hits), how
# often the engine's programs were traced and lowered, what the executable store did, and the
# greedy tokens of one request.
ENGINE_RUN = """
import collections, json, sys
import jax
events = collections.Counter()
def on_duration(event, duration, fun_name="", **kwargs):
    events[event.rsplit("/", 1)[-1]] += 1
    if "_forward_step" in fun_name or "_sample_step" in fun_name:
        events["engine " + event.rsplit("/", 1)[-1]] += 1
def on_event(event, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
        events["hit"] += 1
jax.monitoring.register_event_duration_secs_listener(on_duration)
jax.monitoring.register_event_listener(on_event)
from dataclasses import asdict
from jaxllm.llm_args import KvCacheConfig
from jaxllm.engine.engine_config import EngineConfig
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.sampling import SamplingParams
for overrides in json.loads(sys.argv[2]):
    events.clear()
    compile_only = overrides.pop("compile_only", False)
    warmup = overrides.pop("warmup", True)
    limits = dict(max_batch_size=2, max_num_tokens=16, max_seq_len=64,
                  kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=256))
    engine = LLMEngine(EngineConfig(model=sys.argv[1], **{**limits, **overrides}))
    tokens = None
    if compile_only:
        engine.runner.compile_forward(*engine.planner.empty_step(16))
    else:
        if warmup:
            engine.warmup(all_variants=False)
        request = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        tokens = request.output_token_ids
    engine.runner.close()  # waits for the compile threads (which store what they compiled)
    store = engine.executable_store
    print(json.dumps({"compiles": events["backend_compile_duration"] - events["hit"], "hits": events["hit"],
                      "traced": events["engine jaxpr_trace_duration"],
                      "lowered": events["engine jaxpr_to_mlir_module_duration"],
                      "loaded": engine.runner.programs_loaded, "store": store and asdict(store.counts),
                      "devices": engine.mesh.devices.size, "tokens": tokens,
                      "cache_dir": jax.config.jax_compilation_cache_dir}))
"""
TP2 = dict(tensor_parallel_size=2)


def run_engine_process(model_dir: Path, cache_root: Path, engines: list[dict], **env_overrides: str) -> list[dict]:
    """One new process (two CPU devices) building `engines` in turn; their reports. Every process
    compiles with the same flags (`FAST_COMPILE`: what they compare is what the cache holds)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE", "JAXLLM_COMPILE_CACHE"))
    }
    env.update(
        JAXLLM_CACHE_DIR=str(cache_root),
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count=2 {FAST_COMPILE}",
        **env_overrides,
    )
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE_RUN, str(model_dir), json.dumps(engines)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.strip().splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def populated(tmp_path_factory) -> tuple[Path, Path, list[dict]]:
    """A cache filled by a first process (one engine on one device, one on a mesh of two)."""
    model_dir = materialize_preset("tiny-dense")
    root = tmp_path_factory.mktemp("cache")
    return model_dir, root, run_engine_process(model_dir, root, [{}, TP2])


def test_a_second_process_with_the_same_engine_compiles_and_traces_nothing(populated, tmp_path):
    model_dir, root, first = populated
    cache_dir = Path(first[0]["cache_dir"])
    assert cache_dir.parent == root / "xla"  # $JAXLLM_CACHE_DIR/xla/<host>
    assert [r["devices"] for r in first] == [1, 2]
    for run in first:
        assert run["compiles"] > 0 and run["traced"] > 0 and run["loaded"] == 0
        # The forwards of the one token bucket (16), of its context-logits variant and of the
        # decode buckets of 1 and 2 rows, and the greedy and the general sampler, each for 2 rows
        # and for 1.
        assert run["store"]["saved"] == 8
    entries = [p for p in cache_dir.iterdir() if p.is_file()]
    assert len(entries) >= first[0]["compiles"] - 1  # every program is kept, however small or fast
    stored = list((cache_dir / "executables").iterdir())
    assert len(stored) == sum(run["store"]["saved"] for run in first)

    second = run_engine_process(
        model_dir, root, [{}, TP2, dict(max_num_tokens=32, compile_only=True), dict(seed=1, compile_only=True)]
    )
    for before, after in zip(first, second[:2]):
        assert after["compiles"] == 0, after
        assert after["traced"] == 0 and after["lowered"] == 0, after  # stored programs: loaded, not traced
        assert after["loaded"] == before["store"]["saved"] and after["store"]["rejected"] == 0
        assert after["hits"] + after["loaded"] >= before["compiles"]
        assert after["tokens"] == before["tokens"] and len(after["tokens"]) == 3
    for run in second[2:]:  # another limit or seed: another key, traced and lowered as usual
        assert run["loaded"] == 0 and run["store"]["missing"] == 1 and run["traced"] == 1, run
        # The decode bucket's program itself is unchanged: JAX's cache has it, and an executable
        # read from there is not stored (XLA:CPU cannot serialize a deserialized executable again).
        assert run["compiles"] == 0 and run["store"]["from_jax_cache"] == 1 and run["store"]["saved"] == 0

    off = run_engine_process(model_dir, tmp_path / "off", [dict(warmup=False)], JAXLLM_COMPILE_CACHE="0")[0]
    assert off["hits"] == 0 and off["compiles"] > 0 and off["loaded"] == 0 and not off["cache_dir"]
    assert off["store"] is None and off["tokens"] == first[0]["tokens"]
    assert not (tmp_path / "off" / "xla").exists()


def test_a_damaged_stored_program_is_compiled_again(populated, tmp_path):
    model_dir, root, first = populated
    shutil.copytree(root, tmp_path / "cache")
    cache_dir = Path(first[0]["cache_dir"].replace(str(root), str(tmp_path / "cache")))
    for path in cache_dir.iterdir():  # JAX's entries: what is damaged must really compile again
        if path.is_file():
            path.unlink()
    stored = sorted((cache_dir / "executables").iterdir())
    for i, path in enumerate(stored):  # a flipped byte, a truncated file, an empty file...
        data = bytearray(path.read_bytes())
        if i % 3 == 0:
            data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data[: len(data) // (2 if i % 3 == 1 else 1)] if i % 3 != 2 else b""))
    damaged, again = run_engine_process(model_dir, tmp_path / "cache", [{}, {}])
    assert damaged["loaded"] == 0 and damaged["store"]["rejected"] == first[0]["store"]["saved"], damaged
    assert damaged["traced"] > 0 and damaged["tokens"] == first[0]["tokens"]
    assert damaged["store"]["saved"] == damaged["store"]["rejected"]  # overwritten
    assert again["loaded"] == first[0]["store"]["saved"] and again["traced"] == 0
    assert again["tokens"] == first[0]["tokens"]


def test_switches_turn_the_cache_off(monkeypatch):
    assert compile_cache_requested(True) and not compile_cache_requested(False)
    for value in ("0", "false", "OFF"):
        monkeypatch.setenv("JAXLLM_COMPILE_CACHE", value)
        assert not compile_cache_requested(True)
    monkeypatch.delenv("JAXLLM_COMPILE_CACHE")
    assert "compile_cache" not in engine_kwargs(build_parser().parse_args(["generate"]))
    assert engine_kwargs(build_parser().parse_args(["generate", "--no-compile-cache"]))["compile_cache"] is False
