"""/metrics (Prometheus text, parsed with prometheus_client's own parser) and /v1/iteration_stats."""

from __future__ import annotations

import pytest

pytest.importorskip("httpx")

from fastapi.testclient import TestClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from jaxllm.executor.executor import GenerationExecutor  # noqa: E402
from jaxllm.server.app import build_app  # noqa: E402
from jaxllm.server.server_config import ServerConfig  # noqa: E402

from conftest import tiny_engine  # noqa: E402

MODEL = "tiny-moe"


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_prometheus_metrics_count_requests_tokens_and_latencies():
    engine = tiny_engine(MODEL, max_batch_size=4, max_seq_len=64, max_kv_tokens=512)
    executor = GenerationExecutor(engine)
    with TestClient(build_app(executor, ServerConfig(served_model_name=MODEL), shutdown_executor=True)) as client:
        before = _samples(client.get("/metrics").text)
        assert before[("jaxllm:num_requests_running", ())] == 0
        assert before[("jaxllm:kv_cache_usage_perc", ())] == 0
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": True}
        usage = client.post("/v1/completions", json=body).json()["usage"]
        chat = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with client.stream("POST", "/v1/chat/completions", json=chat) as stream:
            chunks = [line for line in stream.iter_lines() if line.startswith("data: {")]
        import json

        chat_usage = json.loads(chunks[-1][len("data: ") :])["usage"]

        response = client.get("/metrics")
        assert response.headers["content-type"].startswith("text/plain")
        after = _samples(response.text)
        assert after[("jaxllm:request_success_total", (("finished_reason", "length"),))] == 2
        assert after[("jaxllm:prompt_tokens_total", ())] == usage["prompt_tokens"] + chat_usage["prompt_tokens"]
        assert after[("jaxllm:generation_tokens_total", ())] == 5 + 3
        for histogram in (
            "time_to_first_token_seconds",
            "time_per_output_token_seconds",
            "e2e_request_latency_seconds",
        ):
            assert after[(f"jaxllm:{histogram}_count", ())] == 2
            assert after[(f"jaxllm:{histogram}_sum", ())] > 0
        ttft, e2e = (
            after[("jaxllm:time_to_first_token_seconds_sum", ())],
            after[("jaxllm:e2e_request_latency_seconds_sum", ())],
        )
        assert ttft <= e2e
        assert after[("jaxllm:num_requests_running", ())] == 0
        assert after[("jaxllm:num_requests_waiting", ())] == 0
        assert after[("jaxllm:kv_cache_blocks", ())] == engine.kv_cache_manager.num_blocks

        first = client.get("/v1/iteration_stats").json()
        assert first and {"iter", "kvCacheStats", "numActiveRequests"} <= set(first[-1])
        second = client.get("/v1/iteration_stats").json()
        assert second[: len(first)] == first  # reading does not consume


def test_aborted_and_disconnected_requests_are_counted_as_abort():
    """vLLM's finished_reason="abort": a stream whose client went away, and a plain request
    whose client gave up waiting. Afterwards the same greedy canary as before."""
    import time

    import httpx

    from server_helpers import LiveServer

    engine = tiny_engine(MODEL, max_batch_size=4, max_seq_len=2048, max_kv_tokens=4096)
    executor = GenerationExecutor(engine)
    server = LiveServer(build_app(executor, ServerConfig(served_model_name=MODEL)))
    canary_body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    long = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            canary = http.post("/v1/completions", json=canary_body).json()["choices"][0]["text"]
            with http.stream("POST", "/v1/completions", json={**long, "stream": True}) as stream:
                next(stream.iter_lines())  # started; leaving the block closes the connection
            with pytest.raises(httpx.TimeoutException):
                httpx.post(server.url + "/v1/completions", json=long, timeout=0.5)
            deadline = time.monotonic() + 30
            while True:
                samples = _samples(http.get("/metrics").text)
                aborted = samples.get(("jaxllm:request_success_total", (("finished_reason", "abort"),)), 0)
                if aborted >= 2 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert aborted == 2
            assert samples[("jaxllm:request_success_total", (("finished_reason", "length"),))] == 1  # the canary
            assert http.post("/v1/completions", json=canary_body).json()["choices"][0]["text"] == canary
            assert _samples(http.get("/metrics").text)[("jaxllm:num_requests_running", ())] == 0
    finally:
        server.stop()
        executor.shutdown()


def test_background_compiles_pending_and_done():
    import time

    engine = tiny_engine(MODEL, max_batch_size=4, max_seq_len=64, max_kv_tokens=512)
    engine.warmup(background=True)  # decode bucket 4 is left for idle time (1 and 2 come first)
    executor = GenerationExecutor(engine)
    with TestClient(build_app(executor, ServerConfig(served_model_name=MODEL), shutdown_executor=True)) as client:
        ready = _samples(client.get("/metrics").text)
        assert ready[("jaxllm:num_compiles_pending", ())] == 1
        assert ready[("jaxllm:num_compiles_done", ())] == 0
        # Idle for 2 s, the engine compiles it (each scrape is a command: scrape rarely).
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            time.sleep(4)
            later = _samples(client.get("/metrics").text)
            if later[("jaxllm:num_compiles_pending", ())] == 0:
                break
        assert later[("jaxllm:num_compiles_pending", ())] == 0
        # Its forward (its general sampler, of 4 rows, is the token buckets' one: compiled already).
        assert later[("jaxllm:num_compiles_done", ())] == 1


def test_host_kv_tier_counters():
    """With the host KV tier: a prompt evicted from the small device pool comes back from the
    host; /metrics reports the engine's own host-tier totals."""
    from jaxllm.llm_args import KvCacheConfig

    engine = tiny_engine(
        MODEL,
        max_batch_size=2,
        kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=64, host_cache_size=1 << 20),
    )
    executor = GenerationExecutor(engine)
    prompts = [[10 + (i * 7 + j) % 80 for j in range(41)] for i in range(3)]
    with TestClient(build_app(executor, ServerConfig(served_model_name=MODEL), shutdown_executor=True)) as client:
        for prompt in prompts + prompts[:1]:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
            assert client.post("/v1/completions", json=body).status_code == 200
        samples = _samples(client.get("/metrics").text)
        stats = executor.call_on_engine(lambda e: e.kv_offload.stats(), timeout=10)
    host = engine.kv_cache_manager.host_tier
    assert stats["hostReusedBlocks"] == 5 and stats["offloadedBlocks"] >= 5
    assert samples[("jaxllm:kv_cache_host_hits_total", ())] == stats["hostReusedBlocks"]
    assert samples[("jaxllm:kv_onboarded_blocks_total", ())] == stats["onboardedBlocks"]
    assert samples[("jaxllm:kv_offloaded_blocks_total", ())] == stats["offloadedBlocks"]
    assert samples[("jaxllm:kv_offloaded_bytes_total", ())] == stats["offloadedBlocks"] * host.bytes_per_block
    assert samples[("jaxllm:kv_onboarded_bytes_total", ())] == stats["onboardedBlocks"] * host.bytes_per_block
    assert 0 < samples[("jaxllm:kv_host_copy_seconds_total", ())] <= stats["copyTimeMS"] / 1e3
    assert samples[("jaxllm:kv_cache_host_blocks", ())] == host.num_slots
    assert samples[("jaxllm:kv_cache_host_free_blocks", ())] == stats["hostFreeNumBlocks"]
    assert samples[("jaxllm:kv_cache_onboarding_requests", ())] == 0


def test_engine_blocking_reads_and_step_times():
    """The engine's step timing as counters: every step that dispatched is read back once
    (the engine counts it), and the page carries the engine's totals."""
    engine = tiny_engine(MODEL, max_batch_size=4, max_seq_len=64, max_kv_tokens=512)
    executor = GenerationExecutor(engine)
    with TestClient(build_app(executor, ServerConfig(served_model_name=MODEL), shutdown_executor=True)) as client:
        before = _samples(client.get("/metrics").text)
        assert before[("jaxllm:engine_blocking_device_reads_total", ())] == 0
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": True}
        assert client.post("/v1/completions", json=body).status_code == 200
        samples = _samples(client.get("/metrics").text)
        timing, iterations = executor.call_on_engine(lambda e: (e.timing, e.iteration), timeout=10)
        executor_timing = executor.timing()["engine"]
    assert timing.blocking_reads == iterations >= 5  # one read per dispatched step
    assert samples[("jaxllm:engine_blocking_device_reads_total", ())] == timing.blocking_reads
    assert samples[("jaxllm:engine_steps_total", ())] == timing.steps
    for name, total in (
        ("blocking_device_read_seconds", timing.blocking_read_seconds),
        ("host_wall_seconds", timing.host_wall_seconds),
        ("host_cpu_seconds", timing.host_cpu_seconds),
        ("dispatch_wait_seconds", timing.dispatch_wait_seconds),
    ):
        assert samples[(f"jaxllm:engine_{name}_total", ())] == pytest.approx(total)
    assert timing.host_wall_seconds > 0 and timing.host_cpu_seconds > 0
    assert executor_timing["blocking_reads"] == timing.blocking_reads
