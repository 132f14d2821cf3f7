"""Draining many KV cache events over HTTP: pages of at most `max_events`, built off the event
loop, so /health answers while a drain runs and every event arrives once, in order."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from jaxllm.executor import GenerationExecutor
from jaxllm.llm_args import KvCacheConfig
from jaxllm.server.app import KV_EVENTS_PAGE, build_app
from jaxllm.server.server_config import ServerConfig

from conftest import tiny_engine
from server_helpers import LiveServer

MODEL = "tiny-dense"
CANARY = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
NUM_EVENTS = 12_000


@pytest.fixture(scope="module")
def served():
    engine = tiny_engine(
        MODEL, kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=512, event_buffer_max_size=50_000)
    )
    executor = GenerationExecutor(engine)
    server = LiveServer(build_app(executor, ServerConfig(served_model_name=MODEL)))
    with httpx.Client(base_url=server.url, timeout=60) as http:
        canary = http.post("/v1/completions", json=CANARY).json()["choices"][0]["text"]
        yield engine, http, canary
    server.stop()
    executor.shutdown()


def _drain(http, **params) -> list[dict]:
    resp = http.post("/kv_cache_events", params=params)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_events_come_in_pages_in_order_while_health_answers(served):
    engine, http, canary = served
    while _drain(http, max_events=10_000):  # the canary's own events
        pass
    for i in range(NUM_EVENTS):  # stored blocks of 128 tokens: tens of MiB of JSON in all
        engine.kv_events.record("stored", (None, [(1000 + i, list(range(128)), 35)], 0))
    page = _drain(http)
    assert len(page) == KV_EVENTS_PAGE
    events = page
    first_id = page[0]["event_id"]

    # The drain thread keeps the raw body: parsing tens of MiB of JSON here would hold this
    # process's GIL (the server shares it) and stall the health client for the test's own sake.
    raw: list[bytes] = []

    drain_seconds: list[float] = []

    def drain_raw() -> None:
        start = time.monotonic()
        resp = http.post("/kv_cache_events", params={"max_events": 10_000})
        assert resp.status_code == 200, resp.text
        raw.append(resp.content)
        drain_seconds.append(time.monotonic() - start)

    drain = threading.Thread(target=drain_raw)
    latencies = []
    with httpx.Client(base_url=http.base_url, timeout=60) as health:
        drain.start()
        while drain.is_alive():
            start = time.monotonic()
            assert health.get("/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.01)
    drain.join()
    big = json.loads(raw[0])
    assert len(big) == 10_000
    # Health answers all through the drain, never only after it: with the page built on the event
    # loop, the first call would wait for the whole drain. (Relative to the drain's own time, as
    # both stretch alike on a loaded machine.)
    print(f"drain {drain_seconds[0]:.2f} s, health max {max(latencies):.3f} s over {len(latencies)} calls")
    assert len(latencies) >= 3 and max(latencies) < 0.5 * drain_seconds[0], (drain_seconds, latencies)
    events += big
    while page := _drain(http, max_events=700):
        assert len(page) <= 700
        events += page
    assert [e["event_id"] for e in events] == list(range(first_id, first_id + NUM_EVENTS))
    assert [e["data"]["blocks"][0]["block_hash"] for e in events] == list(range(1000, 1000 + NUM_EVENTS))
    assert http.post("/v1/completions", json=CANARY).json()["choices"][0]["text"] == canary


@pytest.mark.parametrize("value", ["0", "-1", "abc", "10001", "9" * 5000, "1.5"])
def test_bad_max_events_is_refused_by_name(served, value):
    engine, http, canary = served
    resp = http.post("/kv_cache_events", params={"max_events": value})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "max_events" and "max_events must be an integer in [1, 10000]" in error["message"]
    assert http.get("/health").status_code == 200
    assert http.post("/v1/completions", json=CANARY).json()["choices"][0]["text"] == canary


def test_python_api_pages_too(served):
    engine, http, canary = served
    _drain(http, max_events=10_000)
    for i in range(5):
        engine.kv_events.record("removed", ([i],))
    first = engine.get_kv_cache_events(0, 2)
    rest = engine.get_kv_cache_events(0)
    assert [e["data"]["block_hashes"] for e in first + rest] == [[i] for i in range(5)]
