"""Multi-host runs: two local processes with 2 CPU devices each, joined by jax.distributed (gloo).

1. Engines spanning both processes (TP 4, then EP 4 with all_to_all across the process
   boundary, its plans sent by the collective channel), warmed up first, give exactly the greedy
   tokens of the single-process, single-device engine on the shared staggered workload (chunked
   prefill, prefix reuse, mixed steps); the follower builds
   each engine from the leader's config and ends its session when the leader shuts it down.
   TP 4 speculating with a draft model (the checkpoint itself) gives the same tokens, its drafts
   verified and drafted on both processes. Then TP 4 with the host KV tier on a workload whose
   prefixes overflow the device pool gives the single-device tokens without the tier, onboarding
   blocks, each process holding the host copies of its own devices' shards.
2. `jaxllm serve` as process 0 with `jaxllm worker` as process 1 answers completions and
   streams; SIGKILL on the worker fails the running stream with an error and the server exits
   non-zero within the bound.
3. SIGKILL on the serving leader makes its follower exit within the bound.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.multihost import ProcessGroup, distributed_flags, wait_for
from tests.parallel_workload import run_staggered_requests, small_engine

ENGINES = {
    "tp4": dict(tensor_parallel_size=4),
    # The plan sent by broadcast_one_to_all instead of the key-value store.
    "ep4": dict(
        tensor_parallel_size=4,
        moe_expert_parallel_size=4,
        moe_config={"dispatch": "all_to_all"},
        multihost_plan_channel="collective",
    ),
    # Speculative decoding: the checkpoint drafting for itself (a draft model); every process
    # verifies the drafts and runs the draft model's program.
    "tp4-draft": dict(tensor_parallel_size=4),
}
# One small decode bucket (steps of one or two decoding rows), not every power of two: fewer
# forwards to compile on each process, and decode buckets still checked across processes against
# the single-device tokens. The served runs below keep the default decode buckets.
COMPILED = dict(decode_batch_sizes=[2])
HOST_TIER_WORKLOAD = dict(num_prefixes=5, prefix_len=40, waves=2, vocab=256)
HOST_TIER_POOL = dict(tokens_per_block=8, max_tokens=96)
EXIT_BOUND = 30.0  # seconds a process may take to exit once its peer is gone


def write_model(root: Path) -> Path:
    from tests.test_ep_moe import write_checkpoint

    return write_checkpoint("qwen3_moe", root / "qwen3_moe", seed=5, vocab_size=256)


def leader_engines(root: Path) -> int:
    """Process 0 of run 1: each engine in turn over all 4 devices of both processes."""
    import jax

    from jaxllm.models import materialize_preset

    assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2
    tokenizer = materialize_preset("tiny-moe")
    from jaxllm.speculative_config import DraftTargetDecodingConfig

    for name, args in ENGINES.items():
        if name == "tp4-draft":
            draft = DraftTargetDecodingConfig(max_draft_len=2, speculative_model_dir=str(root / "qwen3_moe"))
            args = dict(args, speculative_config=draft)
        engine = small_engine(root / "qwen3_moe", tokenizer, **args, **COMPILED)
        if name != "tp4-draft":  # (that one compiles each program on both processes when first run)
            engine.warmup(all_variants=False)  # mirrored runs; the follower compiles alongside
        # Each process reads only its own devices' shards of the checkpoint.
        read = loaded_bytes(root / "qwen3_moe", engine) if name == "tp4" else None
        outputs = run_staggered_requests(engine)
        stats = engine.step_runner.channel_stats
        spec = engine.speculation
        accepted = None if spec is None else (spec.num_accepted_tokens, spec.num_draft_tokens)
        mixed = any(
            s["inflightBatchingStats"]["numContextRequests"] and s["inflightBatchingStats"]["numGenRequests"]
            for s in engine.iteration_stats
        )
        engine.close()
        print(
            json.dumps(
                dict(
                    engine=name,
                    tokens={str(k): v for k, v in sorted(outputs.items())},
                    mixed=mixed,
                    steps=engine.iteration,
                    messages=stats.messages,
                    bytes=stats.bytes,
                    read_share=read,
                    accepted=accepted,
                )
            ),
            flush=True,
        )
    print(json.dumps(host_tier_run(root, tokenizer)), flush=True)
    return 0


def host_tier_run(root: Path, tokenizer: Path) -> dict:
    """TP 4 over both processes with the host KV tier (the copies mirrored to the follower)."""
    from jaxllm import KvCacheConfig
    from jaxllm.engine.kv_blocks import block_bytes
    from tests.kv_tier_workload import interleaved_prefixes

    kv = KvCacheConfig(**HOST_TIER_POOL, host_cache_size=8 << 20)
    engine = small_engine(root / "qwen3_moe", tokenizer, tensor_parallel_size=4, kv_cache_config=kv, **COMPILED)
    engine.kv_offload.warmup()  # the copy programs, on both processes
    tokens = interleaved_prefixes(engine, **HOST_TIER_WORKLOAD)
    offload = engine.kv_offload
    full_bytes = offload.num_slots * block_bytes(engine.runner.kv_cache, engine.kv_cache_manager.num_blocks)
    result = dict(
        engine="tp4-host-tier",
        tokens=tokens,
        onboarded=offload.counts.onboarded_blocks,
        free=engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks,
        host_share=offload.copier.host_bytes / full_bytes,
    )
    engine.close()
    return result


def loaded_bytes(directory: Path, engine) -> float:
    """Share of the checkpoint's bytes this process reads when loading onto the engine's mesh."""
    from safetensors import safe_open

    from jaxllm.models import load_params

    read = []
    load_params(
        directory,
        engine.model_config,
        mesh=engine.mesh,
        slice_hook=lambda name, slices, array: read.append(array.nbytes),
    )
    with safe_open(str(directory / "model.safetensors"), framework="np") as f:
        total = sum(f.get_tensor(n).nbytes for n in f.keys())
    return sum(read) / total


def follower_engines(root: Path) -> int:
    from jaxllm.engine.followers import run_follower

    return run_follower()


def test_engines_spanning_two_processes_match_single_device(tmp_path):
    from jaxllm.models import materialize_preset

    write_model(tmp_path)
    group = ProcessGroup(tmp_path)
    try:
        leader = group.start_function("test_multihost", "leader_engines", 0, 2, tmp_path)
        follower = group.start_function("test_multihost", "follower_engines", 1, 2, tmp_path)
        # The reference, meanwhile: this process's single-device engine on the same workload.
        expected = run_staggered_requests(
            small_engine(tmp_path / "qwen3_moe", materialize_preset("tiny-moe"), **COMPILED)
        )
        expected_host_tier = host_tier_reference(tmp_path)
        assert group.wait(leader, 240) == 0, group.all_logs()
        assert group.wait(follower, 30) == 0, group.all_logs()
    finally:
        group.close()
    results = [json.loads(line) for line in group.log(0).splitlines() if line.startswith("{")]
    host_tier = results.pop()
    assert [r["engine"] for r in results] == list(ENGINES)
    assert host_tier["tokens"] == expected_host_tier, "TP 4 with the host tier differs from one device without it"
    assert host_tier["onboarded"] > 10 and host_tier["free"], host_tier
    # Each process keeps the host copies of its own devices' KV heads: half of every block.
    assert host_tier["host_share"] == 0.5, host_tier
    expected = {str(k): v for k, v in sorted(expected.items())}
    assert len(expected) == 5 and all(len(t) == 7 for t in expected.values())
    for r in results:
        assert r["tokens"] == expected, f"{r['engine']}: greedy tokens differ from the single-device engine"
        assert r["mixed"] or r["accepted"], r["engine"]  # (a speculating engine does not mix steps)
        assert r["messages"] >= r["steps"] > 0 and r["bytes"] > 0, r
    accepted, drafted = results[-1]["accepted"]
    assert drafted >= 8 and accepted > 0.5 * drafted, results[-1]["accepted"]  # it drafts for itself
    # Half the devices: about half of every sharded tensor (norms and the router are replicated).
    assert 0.4 < results[0]["read_share"] < 0.6, results[0]["read_share"]


def host_tier_reference(root: Path) -> list[list[int]]:
    from jaxllm import KvCacheConfig
    from jaxllm.models import materialize_preset
    from tests.kv_tier_workload import interleaved_prefixes

    kv = KvCacheConfig(**HOST_TIER_POOL)
    engine = small_engine(root / "qwen3_moe", materialize_preset("tiny-moe"), kv_cache_config=kv, **COMPILED)
    tokens = interleaved_prefixes(engine, **HOST_TIER_WORKLOAD)
    engine.close()
    return tokens


def serve_argv(model: Path, port: int, group: ProcessGroup, process_id: int) -> list[str]:
    from jaxllm.models import materialize_preset

    return [
        sys.executable,
        "-m",
        "jaxllm",
        "serve",
        "--model",
        str(model),
        "--tokenizer",
        str(materialize_preset("tiny-moe")),
        "--dtype",
        "float32",
        "--max-batch-size",
        "4",
        "--max-num-tokens",
        "16",
        "--max-seq-len",
        "96",
        "--tokens-per-block",
        "8",
        "--kv-cache-max-tokens",
        "512",
        "--tp-size",
        "4",
        "--port",
        str(port),
        "--no-warmup",
        "--log-level",
        "warning",
        *distributed_flags(group.port, 2, process_id),
    ]


def worker_argv(group: ProcessGroup) -> list[str]:
    return [sys.executable, "-m", "jaxllm", "worker", *distributed_flags(group.port, 2, 1)]


def wait_healthy(url: str, group: ProcessGroup, timeout: float = 240) -> None:
    import httpx

    def healthy() -> bool:
        assert all(p.poll() is None for p in group.procs), "a process ended early:\n" + group.all_logs()
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(healthy, timeout, f"{url}/health", interval=0.5)


def stream_events(http, url: str, body: dict):
    with http.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                yield line[len("data: ") :]


def test_server_on_two_processes_and_peer_failures(tmp_path):
    """Three runs at once, each serve (process 0) + follower (process 1). A: completions and
    streaming, then the follower is killed mid-stream. B: the serving leader is killed; its
    follower exits. C: the follower hangs (SIGSTOP) mid-stream: only the heartbeats can tell."""
    import httpx

    from tests.server_helpers import free_port

    model = write_model(tmp_path)
    runs = {}
    for name in "abc":
        (tmp_path / name).mkdir()
        run = ProcessGroup(tmp_path / name)
        port = free_port()
        leader = run.start(serve_argv(model, port, run, 0), "serve")
        # `jaxllm serve` on a process other than 0 follows instead of serving (run b); `jaxllm worker`
        # is the follower's own command.
        follower = run.start(serve_argv(model, port, run, 1) if name == "b" else worker_argv(run), "follower")
        runs[name] = (run, leader, follower, f"http://127.0.0.1:{port}")
    body = dict(model=str(model), prompt=[5, 17, 42, 9, 100], max_tokens=6, temperature=0, ignore_eos=True)
    try:
        for run, _, _, url in runs.values():
            wait_healthy(url, run)
        run, leader, follower, url = runs["b"]
        leader.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        assert run.wait(follower, EXIT_BOUND) != 0
        follower_exit = time.monotonic() - killed_at

        run, leader, follower, url = runs["a"]
        with httpx.Client(timeout=120) as http:
            done = http.post(url + "/v1/completions", json=body).json()
            assert done["usage"]["completion_tokens"] == 6, done
            chunks = [json.loads(e) for e in stream_events(http, url, body) if e != "[DONE]"]
            streamed = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
            assert len(chunks) >= 3 and streamed == done["choices"][0]["text"], (chunks, done)
        exits = {}
        for name, sig in (("a", signal.SIGKILL), ("c", signal.SIGSTOP)):
            run, leader, follower, url = runs[name]
            with httpx.Client(timeout=120) as http:
                events = stream_events(http, url, dict(body, max_tokens=80))  # a long stream
                assert json.loads(next(events))["choices"]
                follower.send_signal(sig)  # after the first token
                hit_at = time.monotonic()
                rest = list(events)
            errors = [json.loads(e)["error"]["message"] for e in rest if e != "[DONE]" and "error" in json.loads(e)]
            assert errors, f"run {name}: the stream ended without an error event: {rest[-3:]}"
            assert run.wait(leader, EXIT_BOUND) != 0
            exits[name] = (time.monotonic() - hit_at, errors[0])
        assert "sent no heartbeat" in exits["c"][1] and "died or hung" in exits["c"][1], exits["c"][1]
    finally:
        for run, *_ in runs.values():
            run.close()
    print(
        f"follower exit {follower_exit:.1f} s after the leader was killed; leader exit {exits['a'][0]:.1f} s "
        f"after the follower was killed ({exits['a'][1][:120]}), {exits['c'][0]:.1f} s after it hung "
        f"({exits['c'][1][:160]})"
    )


def test_sigterm_on_a_follower_or_on_every_process_drains_and_exits_cleanly(tmp_path):
    """A job being stopped signals every process at once (run a): the leader drains its running
    stream and every process exits 0. A follower signalled alone (run b) asks the leader to
    drain and end the run: the same clean exit. (JAX's preemption notifier used to swallow a
    follower's SIGTERM and fail the shutdown barrier 30 s later, with stack dumps.)"""
    import httpx

    from tests.server_helpers import free_port

    model = write_model(tmp_path)
    runs = {}
    for name in "ab":
        (tmp_path / name).mkdir()
        run = ProcessGroup(tmp_path / name)
        port = free_port()
        leader = run.start(serve_argv(model, port, run, 0), "serve")
        follower = run.start(worker_argv(run), "follower")
        runs[name] = (run, leader, follower, f"http://127.0.0.1:{port}")
    body = dict(model=str(model), prompt=[5, 17, 42, 9, 100], max_tokens=24, temperature=0, ignore_eos=True)
    try:
        for run, _, _, url in runs.values():
            wait_healthy(url, run)
        run, leader, follower, url = runs["a"]
        with httpx.Client(timeout=120) as http:
            events = stream_events(http, url, body)
            assert json.loads(next(events))["choices"]
            leader.send_signal(signal.SIGTERM)
            follower.send_signal(signal.SIGTERM)
            rest = [json.loads(e) for e in events if e != "[DONE]"]
        assert rest and not any("error" in e for e in rest), rest[-2:]
        assert rest[-1]["choices"][0]["finish_reason"] == "length", rest[-1]
        assert run.wait(leader, EXIT_BOUND) == 0 and run.wait(follower, EXIT_BOUND) == 0, run.all_logs()

        run, leader, follower, url = runs["b"]
        follower.send_signal(signal.SIGTERM)
        assert run.wait(leader, EXIT_BOUND) == 0 and run.wait(follower, EXIT_BOUND) == 0, run.all_logs()
        assert "asking the leader to drain" in run.log(1), run.all_logs()
        assert "Check failure" not in run.all_logs()
    finally:
        for run, *_ in runs.values():
            run.close()


def test_distributed_detection_and_config_checks():
    from sharding.multihost import DistributedConfig, requested

    assert not requested(DistributedConfig(), environ={})
    assert not requested(DistributedConfig(), environ={"SLURM_STEP_NUM_TASKS": "1", "OMPI_COMM_WORLD_SIZE": "1"})
    assert requested(DistributedConfig(), environ={"SLURM_STEP_NUM_TASKS": "2"})
    assert requested(DistributedConfig(), environ={"OMPI_COMM_WORLD_SIZE": "4"})
    assert requested(DistributedConfig(), environ={"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"})
    assert requested(DistributedConfig("127.0.0.1:1234", 2, 1), environ={})
    for bad, match in (
        (dict(coordinator_address="nohost"), "HOST:PORT"),
        (dict(num_processes=0), "num_processes"),
        (dict(num_processes=2, process_id=2), "not below"),
        (dict(heartbeat_interval=5, heartbeat_timeout=2), "heartbeat_interval"),
    ):
        with pytest.raises(ValueError, match=match):
            DistributedConfig(**bad)
