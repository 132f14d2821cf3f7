"""The OpenAI-compatible server, driven by the official `openai` client against a live uvicorn server."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest

from jaxllm.executor import GenerationExecutor
from jaxllm.server.app import build_app
from jaxllm.server.server_config import ServerConfig

from conftest import tiny_engine
from server_helpers import LiveServer, assert_no_thread_left, wait_idle
from server_helpers import live_threads as _threads

MODEL = "tiny-moe"
API_KEY = "test-key"
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def engine():
    # Context chunks come in whole KV blocks: 8 decoding requests still leave room for one.
    return tiny_engine(MODEL)


@pytest.fixture(scope="module")
def live(engine):
    before = _threads()
    executor = GenerationExecutor(engine)
    server = LiveServer(
        build_app(
            executor,
            ServerConfig(served_model_name=MODEL, api_key=API_KEY, max_body_bytes=MAX_BODY),
            shutdown_executor=True,
        )
    )
    server.executor = executor
    yield server
    server.stop()
    executor.shutdown()
    assert_no_thread_left(before)
    stats = engine.kv_cache_manager.get_kv_cache_stats()
    assert stats.free_num_blocks == stats.max_num_blocks


@pytest.fixture
def client(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def _wait_idle(live, timeout: float = 20.0) -> None:
    wait_idle(live.executor, timeout)


# ---------------------------------------------------------------------------- fatal errors
def test_fatal_engine_error_makes_health_503(engine):
    """A fatal engine error fails requests and /health says 503. Runs first: it borrows the module's
    engine before the shared server starts (an engine belongs to one executor at a time)."""
    executor = GenerationExecutor(engine)
    server = LiveServer(build_app(executor, ServerConfig(served_model_name=MODEL)), exit_when_engine_dies=False)
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 100, "ignore_eos": True}
        with httpx.Client(timeout=60) as http:

            def boom():
                raise RuntimeError("device lost")

            executor.call_on_engine(lambda e: setattr(e, "step", boom))
            resp = http.post(server.url + "/v1/completions", json=body)
            assert resp.status_code in (500, 503)
            assert httpx.get(server.url + "/health").status_code == 503
    finally:
        server.stop()
        executor.shutdown()
        del engine.step
        for rid in list(engine.active):
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()


# ---------------------------------------------------------------------------- plain routes
def test_info_routes(live, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(live.url + "/health").status_code == 200
    assert httpx.get(live.url + "/version").json()["version"]
    client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    stats = httpx.get(live.url + "/v1/iteration_stats", headers=auth).json()
    assert isinstance(stats, list) and stats and "kvCacheStats" in stats[-1]
    again = httpx.get(live.url + "/v1/iteration_stats", headers=auth).json()
    assert again[: len(stats)] == stats  # reading the stats does not consume them
    prometheus = httpx.get(live.url + "/metrics")
    assert prometheus.headers["content-type"].startswith("text/plain")
    assert "jaxllm:request_success_total" in prometheus.text


# ---------------------------------------------------------------------------- completions
def test_completion_and_its_stream_agree(live, client):
    full = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=12, extra_body={"ignore_eos": True}
    )
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert full.usage.completion_tokens == 12 and full.usage.total_tokens == full.usage.prompt_tokens + 12
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The capital of France is",
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_batch_n_stop_and_logprobs(live, client):
    out = client.completions.create(
        model=MODEL, prompt=["Once upon a time", "The sky is"], max_tokens=6, n=2, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 24
    base = (
        client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=16, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    stop = next(
        base[i : i + 2]
        for i in range(3, len(base) - 2)
        if base[i : i + 2].strip() and "\ufffd" not in base[i : i + 2] and base.find(base[i : i + 2]) == i
    )
    cut = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=16, stop=[stop], extra_body={"ignore_eos": True}
    ).choices[0]
    assert cut.text == base[: base.index(stop)] and cut.finish_reason == "stop"
    lp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, logprobs=2).choices[0]
    assert len(lp.logprobs.tokens) == len(lp.logprobs.token_logprobs) == 4
    assert all(len(top) >= 1 for top in lp.logprobs.top_logprobs)


# ---------------------------------------------------------------------------- chat
def test_chat_completion_and_stream(live, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, extra_body={"ignore_eos": True}
    )
    msg = full.choices[0].message
    assert msg.role == "assistant" and full.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert chunks[-1].usage.completion_tokens == 10 == full.usage.completion_tokens
    assert full.usage.prompt_tokens == chunks[-1].usage.prompt_tokens


# ---------------------------------------------------------------------------- concurrency
def test_64_concurrent_streams(live):
    async def one(client, i):
        stream = await client.completions.create(
            model=MODEL,
            prompt=f"Request number {i}:",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage
        return text, usage, finish

    async def run():
        async with openai.AsyncOpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(run())
    assert len(results) == 64
    assert all(finish == "length" and usage.completion_tokens == 6 for _, usage, finish in results)
    _wait_idle(live)


# ---------------------------------------------------------------------------- disconnects
def test_stream_disconnect_aborts_and_frees_blocks(live):
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 120, "stream": True, "ignore_eos": True}
    aborted = live.app.state.server.disconnects
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", live.url + "/v1/completions", json=body, headers=headers) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data: {"):
                    got += 1
                    if got == 2:
                        break
            assert live.executor.num_unfinished == 1
    # the connection is closed mid-stream: the request must be aborted, not run to the end
    _wait_idle(live, timeout=10)
    assert live.app.state.server.disconnects == aborted + 1


def test_non_streaming_disconnect_aborts(live):
    body = json.dumps({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 120, "ignore_eos": True}).encode()
    aborted = live.app.state.server.disconnects
    with socket.create_connection(("127.0.0.1", live.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 10
        while live.executor.num_unfinished == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert live.executor.num_unfinished == 1
    _wait_idle(live, timeout=10)
    assert live.app.state.server.disconnects == aborted + 1


def test_beam_search_fields(client, live):
    """vLLM's extra fields: use_beam_search (width best_of, else n), length_penalty, early_stopping."""
    resp = client.completions.create(
        model=MODEL,
        prompt="hello there",
        max_tokens=4,
        n=2,
        best_of=3,
        extra_body={"use_beam_search": True, "length_penalty": 0.5, "early_stopping": True, "ignore_eos": True},
    )
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage.completion_tokens == 8
    # Streamed: the beams arrive once, finished (they change until the end).
    stream = client.completions.create(
        model=MODEL,
        prompt="hello there",
        max_tokens=4,
        n=2,
        best_of=3,
        stream=True,
        extra_body={"use_beam_search": True, "length_penalty": 0.5, "early_stopping": True, "ignore_eos": True},
    )
    text = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            text[c.index] += c.text
    assert text == {c.index: c.text for c in resp.choices}
    _wait_idle(live)


# ---------------------------------------------------------------------------- bad requests
BAD_COMPLETIONS = [
    ({"prompt": "hi"}, "model"),
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"model": MODEL, "prompt": "hi", "top_k": -5}, "top_k"),
    ({"model": MODEL, "prompt": "hi", "n": 0}, "n"),
    ({"model": MODEL, "prompt": "hi", "n": 1, "best_of": 2, "stream": True}, "best_of"),
    ({"model": MODEL, "prompt": "hi", "n": 3, "best_of": 2}, "best_of"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "n": 2, "use_beam_search": True, "temperature": 0.7}, "temperature"),
    (
        {"model": MODEL, "prompt": "hi", "n": 2, "use_beam_search": True, "early_stopping": "sometimes"},
        "early_stopping",
    ),
    ({"model": MODEL, "prompt": "hi", "length_penalty": 2.0}, "length_penalty"),
    ({"model": MODEL, "prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ({"model": MODEL, "prompt": "hi", "stop": [""]}, "stop"),
    ({"model": MODEL, "prompt": "hi", "stop": 5}, "stop"),
    ({"model": MODEL, "prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
    ({"model": MODEL, "prompt": "hi", "min_tokens": 20, "max_tokens": 4}, "min_tokens"),
    ({"model": MODEL, "prompt": "hi", "seed": -1}, "seed"),
    ({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": MODEL, "prompt": "hi", "echo": True}, "echo"),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"model": MODEL, "prompt": "hi", "not_a_field": 1}, "not_a_field"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": []}, "prompt"),
    ({"model": MODEL, "prompt": [1, 2, 10**9]}, "prompt"),
    ({"model": MODEL, "prompt": "x " * 200, "max_tokens": 16}, "prompt"),
    ({"model": MODEL, "prompt": [5] * 100, "max_tokens": 100}, "max_tokens"),
]

BAD_CHAT = [
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
        "max_completion_tokens",
    ),
    (
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        },
        "response_format.json_schema.schema",
    ),
]


@pytest.mark.parametrize(
    "body,field", BAD_COMPLETIONS, ids=[f"completions-{f}-{i}" for i, (_, f) in enumerate(BAD_COMPLETIONS)]
)
def test_bad_completion_requests_get_400(live, client, body, field):
    resp = httpx.post(live.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    assert field in error["message"], error
    # the official client surfaces it as BadRequestError
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/completions", body=body, cast_to=httpx.Response)
    assert info.value.status_code == 400


@pytest.mark.parametrize("body,field", BAD_CHAT, ids=[f"chat-{f}-{i}" for i, (_, f) in enumerate(BAD_CHAT)])
def test_bad_chat_requests_get_400(live, body, field):
    resp = httpx.post(live.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == 400 and field in error["message"], error


def test_malformed_oversized_unauthorized_and_unknown(live, client):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        resp = httpx.post(live.url + "/v1/completions", content=raw, headers=headers)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == 400
    big = json.dumps({"model": MODEL, "prompt": "x" * (2 * MAX_BODY)})
    resp = httpx.post(live.url + "/v1/completions", content=big, headers=headers)
    assert resp.status_code == 413 and "exceeds" in resp.json()["error"]["message"]

    def chunked():
        for _ in range(4):
            yield b" " * MAX_BODY

    resp = httpx.post(live.url + "/v1/completions", content=chunked(), headers=headers)
    assert resp.status_code == 413
    resp = httpx.post(live.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other-model", prompt="hi", max_tokens=2)
    assert httpx.get(live.url + "/v1/nothing-here", headers=headers).status_code == 404
    assert httpx.get(live.url + "/health").status_code == 200  # still healthy after all of that
    _wait_idle(live)
