"""Hostile clients against a live server (raw httpx and the official openai client) and the Python API.

Every bad request must get a 4xx in OpenAI's error shape naming the field, and afterwards
the server must still be healthy and give the same greedy answer as before. One live
server serves the whole module; the lifecycle tests (engine failure, SIGTERM) run first
or in a subprocess.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from jaxllm.executor import GenerationExecutor
from jaxllm.llm import LLM
from jaxllm.sampling import GuidedDecodingParams, SamplingParams
from jaxllm.server.app import build_app
from jaxllm.server.lifecycle import ENGINE_DEAD_EXIT_CODE
from jaxllm.server.server_config import ServerConfig

from conftest import tiny_engine
from server_helpers import LiveServer as _ServedApp
from server_helpers import assert_no_thread_left, wait_idle
from server_helpers import free_port as _free_port
from server_helpers import live_threads as _threads

MODEL = "tiny-moe"
MAX_BODY = 1024 * 1024
HEADER_TIMEOUT = 2.0
MAX_SEQ_LEN = 2048  # long enough that tokenizing the longest text prompt takes a while
CANARY = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def _num_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def LiveServer(app, shutdown_timeout: float = 5.0) -> _ServedApp:
    """This module's server: request heads must arrive within HEADER_TIMEOUT."""
    return _ServedApp(app, shutdown_timeout=shutdown_timeout, header_timeout=HEADER_TIMEOUT)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(MODEL, max_seq_len=MAX_SEQ_LEN)


def _reset_engine(engine) -> None:
    """Put the shared engine back in order after an executor died on it."""
    engine.__dict__.pop("step", None)
    for rid in list(engine.active):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


# ---------------------------------------------------------------------------- a dead engine ends the process
def test_engine_failure_fails_waiters_and_stops_the_server_nonzero(engine):
    """Runs before the shared server starts (an engine belongs to one executor at a time)."""
    executor = GenerationExecutor(engine)
    server = LiveServer(build_app(executor, ServerConfig(served_model_name=MODEL)))
    try:
        with httpx.Client(timeout=60) as http:
            assert http.get(server.url + "/health").status_code == 200
            with http.stream(
                "POST",
                server.url + "/v1/completions",
                json={"model": MODEL, "prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True},
            ) as resp:
                lines = resp.iter_lines()
                assert next(line for line in lines if line.startswith("data: {"))

                def boom():
                    raise RuntimeError("device lost")

                executor.call_on_engine(lambda e: setattr(e, "step", boom))
                rest = [line for line in lines if line.startswith("data: ")]
        # The stream ended with an error event and [DONE], not a reset connection.
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["error"]["code"] == 500
        server.thread.join(15)
        assert not server.thread.is_alive(), "the server did not stop after the engine died"
        assert server.server.exit_code == ENGINE_DEAD_EXIT_CODE
    finally:
        server.stop()
        executor.shutdown()
        _reset_engine(engine)


# ---------------------------------------------------------------------------- the shared server
@pytest.fixture(scope="module")
def live(engine):
    before = _threads()
    executor = GenerationExecutor(engine)
    server = LiveServer(
        build_app(
            executor,
            ServerConfig(served_model_name=MODEL, max_body_bytes=MAX_BODY, body_timeout=2.0),
            shutdown_executor=True,
        )
    )
    server.executor = executor
    with httpx.Client(timeout=60) as http:
        server.canary = http.post(server.url + "/v1/completions", json=CANARY).json()["choices"][0]["text"]
    yield server
    server.stop()
    executor.shutdown()
    assert_no_thread_left(before)
    stats = engine.kv_cache_manager.get_kv_cache_stats()
    assert stats.free_num_blocks == stats.max_num_blocks


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _assert_still_serving(live, http) -> None:
    assert http.get("/health").status_code == 200
    assert http.post("/v1/completions", json=CANARY).json()["choices"][0]["text"] == live.canary


def _assert_openai_error(resp: httpx.Response, status: int, field: str) -> None:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json"), resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert isinstance(error["message"], str) and field.lower() in error["message"].lower(), error


C = "/v1/completions"
CH = "/v1/chat/completions"
BASE = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _c(**fields):
    return {**BASE, **fields}


def _ch(**fields):
    return {**CHAT, **fields}


def _nested(depth: int, leaf="x") -> object:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


# (route, body (dict, or raw bytes), status, text the error message must contain)
CASES = [
    # --- strict types: no string-to-number coercion, booleans are not integers
    (C, _c(max_tokens="16"), 400, "max_tokens"),
    (C, _c(max_tokens=16.0), 400, "max_tokens"),
    (C, _c(max_tokens=True), 400, "max_tokens"),
    (C, _c(max_tokens=-1), 400, "max_tokens"),
    (C, _c(max_tokens=0), 400, "max_tokens"),
    (C, _c(max_tokens=10**30), 400, "max_tokens"),
    (C, _c(n="2"), 400, "n"),
    (C, _c(n=True), 400, "n"),
    (C, _c(n=1.5), 400, "n"),
    (C, _c(n=129), 400, "n"),
    (C, _c(n=0), 400, "n"),
    (C, _c(stream="yes"), 400, "stream"),
    (C, _c(stream=1), 400, "stream"),
    (C, _c(prompt=[True, False]), 400, "prompt"),
    (C, _c(prompt=[[True]]), 400, "prompt"),
    (C, _c(prompt=5), 400, "prompt"),
    (C, _c(prompt=None), 400, "prompt"),
    (C, _c(prompt={"text": "hi"}), 400, "prompt"),
    (C, _c(prompt=[1.5, 2]), 400, "prompt"),
    (C, _c(prompt=["a", 1]), 400, "prompt"),
    (C, _c(prompt=[-1]), 400, "prompt"),
    (C, _c(prompt=[2**31]), 400, "prompt"),
    (C, _c(prompt=[10**30]), 400, "prompt"),
    (C, _c(prompt=[453]), 400, "prompt"),  # one past the vocabulary
    (C, _c(prompt=""), 400, "prompt"),
    (C, _c(prompt=[]), 400, "prompt"),
    (C, _c(prompt=[""]), 400, "prompt"),
    (C, _c(prompt=[[]]), 400, "prompt"),
    (C, _c(prompt="\ud800"), 400, "prompt"),
    (C, _c(prompt=["ok", "\udfff"]), 400, "prompt"),
    (C, _c(prompt="x " * 3000), 400, "prompt"),  # more tokens than max_seq_len
    (C, _c(prompt="x" * 120_000), 400, "prompt"),  # more characters than max_seq_len tokens can hold
    (C, _c(prompt=[5] * 3000), 400, "prompt"),
    (C, _c(prompt=[5] * 100, max_tokens=2000), 400, "max_tokens"),
    (C, _c(prompt=["a", "b", "c"], n=128), 400, "n"),
    (C, _c(temperature="0.5"), 400, "temperature"),
    (C, _c(temperature=-0.1), 400, "temperature"),
    (C, _c(temperature=3), 400, "temperature"),
    (C, _c(temperature=True), 400, "temperature"),
    (C, _c(top_p=0), 400, "top_p"),
    (C, _c(top_p="1"), 400, "top_p"),
    (C, _c(top_p=1.5), 400, "top_p"),
    (C, _c(top_k=1.5), 400, "top_k"),
    (C, _c(top_k=-2), 400, "top_k"),
    (C, _c(top_k=2**40), 400, "top_k"),
    (C, _c(top_k="5"), 400, "top_k"),
    (C, _c(min_p=2), 400, "min_p"),
    (C, _c(min_p="0"), 400, "min_p"),
    (C, _c(repetition_penalty=0), 400, "repetition_penalty"),
    (C, _c(repetition_penalty=-1), 400, "repetition_penalty"),
    (C, _c(repetition_penalty="1.1"), 400, "repetition_penalty"),
    (C, _c(presence_penalty=5), 400, "presence_penalty"),
    (C, _c(frequency_penalty=-3), 400, "frequency_penalty"),
    (C, _c(frequency_penalty="1"), 400, "frequency_penalty"),
    (C, _c(seed=-1), 400, "seed"),
    (C, _c(seed=2**64), 400, "seed"),
    (C, _c(seed="1"), 400, "seed"),
    (C, _c(seed=1.0), 400, "seed"),
    (C, _c(stop=5), 400, "stop"),
    (C, _c(stop=[""]), 400, "stop"),
    (C, _c(stop=["a"] * 17), 400, "stop"),
    (C, _c(stop=[1]), 400, "stop"),
    (C, _c(stop="\ud800"), 400, "stop"),
    (C, _c(stop_token_ids=[-1]), 400, "stop_token_ids"),
    (C, _c(stop_token_ids=["1"]), 400, "stop_token_ids"),
    (C, _c(stop_token_ids=[True]), 400, "stop_token_ids"),
    (C, _c(stop_token_ids=5), 400, "stop_token_ids"),
    (C, _c(stop_token_ids=[1099511627776], min_tokens=1), 400, "stop_token_ids"),
    (C, _c(stop_token_ids=list(range(17)), min_tokens=2), 400, "stop_token_ids"),
    (C, _c(min_tokens=-1), 400, "min_tokens"),
    (C, _c(min_tokens=20), 400, "min_tokens"),
    (C, _c(min_tokens="1"), 400, "min_tokens"),
    (C, _c(ignore_eos="true"), 400, "ignore_eos"),
    (C, _c(include_stop_str_in_output=1), 400, "include_stop_str_in_output"),
    (C, _c(skip_special_tokens="no"), 400, "skip_special_tokens"),
    (C, _c(add_special_tokens="yes"), 400, "add_special_tokens"),
    (C, _c(logprobs=21), 400, "logprobs"),
    (C, _c(logprobs=-1), 400, "logprobs"),
    (C, _c(logprobs="2"), 400, "logprobs"),
    (C, _c(logprobs=True), 400, "logprobs"),
    (C, _c(best_of=0), 400, "best_of"),
    (C, _c(best_of=1, n=2), 400, "best_of"),
    (C, _c(best_of="2"), 400, "best_of"),
    (C, _c(best_of=2, stream=True), 400, "best_of"),
    (C, _c(echo=True), 400, "echo"),
    (C, _c(suffix="x"), 400, "suffix"),
    (C, _c(logit_bias={"5": 1.0}), 400, "logit_bias"),
    (C, _c(user=5), 400, "user"),
    (C, _c(stream_options={"include_usage": True}), 400, "stream_options"),
    (C, _c(stream=True, stream_options={"include_usage": "yes"}), 400, "stream_options"),
    (C, _c(stream=True, stream_options={"continuous_usage_stats": True}), 400, "continuous_usage_stats"),
    (C, _c(stream=True, stream_options={"bogus": 1}), 400, "stream_options"),
    # --- unsupported fields are refused, not ignored
    (C, _c(truncate_prompt_tokens=5), 400, "truncate_prompt_tokens"),
    (C, _c(prompt_logprobs=21), 400, "prompt_logprobs"),
    (C, _c(prompt_logprobs=1, stream=True), 400, "prompt_logprobs"),
    (C, _c(logits_processors=["my_module.Ban"]), 400, "logits_processors"),
    (C, _c(logits_post_processor_name="ban"), 400, "logits_post_processor_name"),
    (CH, _ch(logits_processor="x"), 400, "logits_processor"),
    (C, _c(guided_json={"type": "nonsense"}), 400, "guided_json"),
    (C, _c(guided_regex="(" * 50), 400, "guided_regex"),
    (C, _c(structured_outputs={"grammar": "start: " + "a " * 10}), 400, "structured_outputs.grammar"),
    (C, _c(guided_choice="yes"), 400, "guided_choice"),
    (C, _c(not_a_field=1), 400, "not_a_field"),
    (C, _c(model=5), 400, "model"),
    (C, {"prompt": "hi"}, 400, "model"),
    (C, {"model": MODEL}, 400, "prompt"),
    (C, _c(model="other-model"), 404, "model"),
    # --- chat
    (CH, _ch(messages="hi"), 400, "messages"),
    (CH, _ch(messages=[]), 400, "messages"),
    (CH, _ch(messages=[5]), 400, "messages"),
    (CH, _ch(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages"),
    (CH, _ch(messages=[{"role": "user", "content": 5}]), 400, "messages"),
    (CH, _ch(messages=[{"role": "user", "content": "\ud800"}]), 400, "messages"),
    (CH, _ch(messages=[{"role": "user", "content": "hi", "name": "\udc00"}]), 400, "messages"),
    (CH, _ch(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), 400, "messages"),
    (CH, _ch(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]), 400, "messages"),
    (CH, _ch(messages=[{"role": "user", "content": "x " * 3000}]), 400, "messages"),
    (CH, _ch(messages=[{"role": "user", "content": "hi", "extra": _nested(40)}]), 400, "messages"),
    (CH, _ch(chat_template="{{ 'x' * 100000000 }}"), 400, "chat_template"),
    (CH, _ch(chat_template_kwargs={"chat_template": "{{ 'x' }}"}), 400, "chat_template"),
    (CH, _ch(chat_template_kwargs={"tokenize": True}), 400, "chat_template_kwargs"),
    (CH, _ch(chat_template_kwargs="x"), 400, "chat_template_kwargs"),
    (CH, _ch(chat_template_kwargs={"deep": _nested(40)}), 400, "chat_template_kwargs"),
    (CH, _ch(logprobs="true"), 400, "logprobs"),
    (CH, _ch(logprobs=1), 400, "logprobs"),
    (CH, _ch(top_logprobs=2), 400, "top_logprobs"),
    (CH, _ch(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    (CH, _ch(logprobs=True, top_logprobs="2"), 400, "top_logprobs"),
    (CH, _ch(max_completion_tokens=0), 400, "max_completion_tokens"),
    (CH, _ch(max_completion_tokens="5"), 400, "max_completion_tokens"),
    (CH, _ch(max_tokens="5"), 400, "max_tokens"),
    (CH, _ch(tools=[{"type": "function"}]), 400, "tools"),
    (CH, _ch(tool_choice="required"), 400, "tool_choice"),
    (CH, _ch(tools=[{"type": "function", "function": {"name": "a b"}}]), 400, "tools[0].function.name"),
    (CH, _ch(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), 400, "tools[0]"),
    (
        CH,
        _ch(
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        "tool_choice",
    ),
    (
        CH,
        _ch(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
        400,
        "response_format.json_schema.schema",
    ),
    (
        CH,
        _ch(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": _nested(40)}}),
        400,
        "response_format",
    ),
    (CH, _ch(response_format={"type": "xml"}), 400, "response_format"),
    (CH, _ch(n="2"), 400, "n"),
    (CH, _ch(stream="yes"), 400, "stream"),
    (CH, _ch(add_generation_prompt="no"), 400, "add_generation_prompt"),
    (CH, _ch(parallel_tool_calls="x"), 400, "parallel_tool_calls"),
    (CH, _ch(temperature="1"), 400, "temperature"),
    (CH, _ch(stop_token_ids=[2**40]), 400, "stop_token_ids"),
    (CH, _ch(prompt_logprobs=1), 400, "prompt_logprobs"),
    (C, _c(use_beam_search=True, n=2, temperature=0, length_penalty=1e308), 400, "length_penalty"),
    (C, _c(prompt_logprobs=21), 400, "prompt_logprobs"),
    (C, _c(use_beam_search=True, n=2, temperature=0, length_penalty=-1e308), 400, "length_penalty"),
    (CH, _ch(model="other-model"), 404, "model"),
    # --- malformed bodies (no field to name: the message says what is wrong with the body)
    (C, b'{"model":', 400, "JSON"),
    (C, b"[1, 2]", 400, "JSON object"),
    (C, b"\xff\xfe", 400, "JSON"),
    (C, b"", 400, "JSON"),
    (C, b'{"model": "tiny-moe", "prompt": "hi", "max_tokens": NaN}', 400, "max_tokens"),
    (C, b'{"model": "tiny-moe", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nests deeper"),
    (C, b"[" * 100_000 + b"]" * 100_000, 400, "nests deeper"),
    (CH, b'{"model": "tiny-moe", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nests deeper"),
    (C, json.dumps(_c(prompt=_nested(40, 5))).encode(), 400, "prompt"),
    (C, json.dumps(_c(prompt="x" * (MAX_BODY + 1))).encode(), 413, "exceeds"),
]


def _case_id(case) -> str:
    route, body, status, field = case
    name = "chat" if route == CH else "cmpl"
    return f"{name}-{status}-{field.replace(' ', '_')}"


@pytest.mark.parametrize("case", CASES, ids=[f"{_case_id(c)}-{i}" for i, c in enumerate(CASES)])
def test_hostile_request_gets_4xx_and_the_server_goes_on(live, http, client, case):
    route, body, status, field = case
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # ASCII: lone surrogates stay escaped
    resp = http.post(route, content=raw, headers={"Content-Type": "application/json"})
    _assert_openai_error(resp, status, field)
    if isinstance(body, dict) and "\\ud" not in raw.decode() and "\\udc" not in raw.decode():
        # The official client sees the same error as its typed exception.
        with pytest.raises(openai.APIStatusError) as info:
            client.post(route.removeprefix("/v1"), body=body, cast_to=httpx.Response)
        assert info.value.status_code == status and field.lower() in info.value.message.lower()
    _assert_still_serving(live, http)


def test_there_are_at_least_100_hostile_cases():
    assert len(CASES) + len(PYTHON_CASES) >= 100


def test_oversized_body_by_stream_slow_body_and_methods(live, http):
    def chunked():
        for _ in range(4):
            yield b" " * MAX_BODY

    _assert_openai_error(http.post(C, content=chunked()), 413, "exceeds")

    def slow():  # a body that stops arriving: 408 after body_timeout, not a connection held forever
        yield b'{"model": "tiny-moe", '
        time.sleep(4)
        yield b'"prompt": "hi"}'

    _assert_openai_error(http.post(C, content=slow()), 408, "did not arrive")
    _assert_openai_error(http.get(C), 405, "not allowed")
    _assert_openai_error(http.get("/v1/nothing-here"), 404, "no route")
    _assert_still_serving(live, http)


def test_idle_and_slow_head_connections_are_closed(live, http):
    """Neither an idle connection nor one that sends its request head a byte at a time is held."""
    fds = _num_fds()
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 100
    with (
        socket.create_connection(("127.0.0.1", live.port)) as idle,
        socket.create_connection(("127.0.0.1", live.port)) as slow,
    ):
        started = time.monotonic()
        slow.settimeout(0.3)
        closed = False
        for byte in head:  # one byte every 0.3 s: the whole head would take 40 s
            try:
                slow.sendall(bytes([byte]))
                closed = slow.recv(1024) == b""
            except TimeoutError:
                pass
            except OSError:
                closed = True
            if closed:
                break
        assert closed and time.monotonic() - started < HEADER_TIMEOUT + 2
        idle.settimeout(HEADER_TIMEOUT + 2)
        assert idle.recv(1024) == b""  # closed without a response: it never asked for anything
    _assert_still_serving(live, http)
    deadline = time.monotonic() + 5
    while _num_fds() > fds and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _num_fds() <= fds


def test_request_chat_template_needs_the_trust_flag(live, http):
    body = _ch(chat_template="{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}", max_tokens=2)
    _assert_openai_error(http.post(CH, json=body), 400, "--trust-request-chat-template")
    config = live.app.state.server.config
    config.trust_request_chat_template = True
    try:
        resp = http.post(CH, json=body)
        assert resp.status_code == 200, resp.text
        # The rendered prompt is the client's template: "<<hi>>" and nothing of the model's own.
        tokenizer = live.executor.tokenizer
        assert resp.json()["usage"]["prompt_tokens"] == len(tokenizer.encode("<<hi>>", add_special_tokens=False))
    finally:
        config.trust_request_chat_template = False


# ---------------------------------------------------------------------------- the Python API
PYTHON_CASES = [
    ("generate", ("\ud800",), {}, "surrogate"),
    ("generate", (["ok", "a\udfffb"],), {}, "surrogate"),
    ("generate", ([True, False],), {}, "token ids"),
    ("generate", (np.array([1.5, 2.0]),), {}, "integer"),
    ("generate", (np.array([[[1]]]),), {}, "1-D"),
    ("generate", ([],), {}, "empty"),
    ("generate", (5,), {}, "inputs"),
    ("generate", ([10**30],), {}, "prompt"),
    ("generate", ("hi", SamplingParams(max_tokens=5000)), {}, "max_tokens"),
    ("generate_async", ("x",), {"priority": "high"}, "priority"),
    ("generate_async", ("x",), {"priority": float("nan")}, "priority"),
    ("generate_async", ("x",), {"timeout": -1}, "timeout"),
    ("params", (), {"bad_token_ids": [2**40]}, "bad_token_ids"),
    ("params", (), {"end_id": 2**40, "min_tokens": 1}, "end_id"),
    ("params", (), {"stop_token_ids": list(range(17)), "min_tokens": 2}, "stop_token_ids"),
    ("params", (), {"truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
    ("params", (), {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("params", (), {"max_tokens": "16"}, "max_tokens"),
    ("params", (), {"n": True}, "n"),
    ("params", (), {"use_beam_search": True, "n": 2, "length_penalty": 1e308}, "length_penalty"),
    ("params", (), {"guided_decoding": GuidedDecodingParams(json={"type": "nonsense"})}, "guided_decoding.json"),
    ("params", (), {"guided_decoding": GuidedDecodingParams(grammar="start: (")}, "guided_decoding.grammar"),
    ("params", (), {"guided_decoding": {"regex": "a+"}}, "guided_decoding"),
]


@pytest.mark.parametrize("case", PYTHON_CASES, ids=[f"{c[0]}-{c[3]}-{i}" for i, c in enumerate(PYTHON_CASES)])
def test_python_api_refuses_bad_input_with_value_error(live, http, case):
    kind, args, kwargs, field = case
    llm = LLM.from_executor(live.executor)
    with pytest.raises(ValueError, match=f"(?i){field}"):
        if kind == "params":
            llm.generate("hi", SamplingParams(**{"max_tokens": 4, **kwargs}), use_tqdm=False)
        elif kind == "generate":
            llm.generate(*args, use_tqdm=False)
        else:
            llm.generate_async(*args, **kwargs)
    _assert_still_serving(live, http)


def test_beam_search_of_one_beam_gives_the_greedy_canary(live, http):
    for extra in ({"n": 1}, {"n": 1, "best_of": 1, "length_penalty": -10}):
        resp = http.post(C, json={**CANARY, "use_beam_search": True, **extra})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == live.canary
    _assert_still_serving(live, http)


def test_numpy_token_ids_are_accepted(live):
    llm = LLM.from_executor(live.executor)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    expected = llm.generate([5, 6, 7], params).outputs[0].token_ids
    assert llm.generate(np.array([5, 6, 7], np.int64), params).outputs[0].token_ids == expected
    batch = llm.generate(np.array([[5, 6, 7], [5, 6, 7]], np.int32), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batch] == [expected, expected]


# ---------------------------------------------------------------------------- nothing slow on the event loop
def test_health_answers_fast_while_max_size_prompts_are_tokenized(live, http, tmp_path):
    """The largest text prompt the server will tokenize (max_prompt_chars characters that the byte
    fallback splits into three tokens each), eight at once: /health must still answer within 100 ms.
    The eight clients run in another process, as real clients do, so that their own Python
    work does not compete with the server's for this process's interpreter lock."""
    limit = live.app.state.server.max_prompt_chars
    rng = random.Random(0)
    prompt = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(limit))
    body = tmp_path / "body.json"
    body.write_bytes(json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode())
    assert body.stat().st_size <= MAX_BODY
    started = time.perf_counter()
    assert len(live.executor.tokenizer.encode(prompt)) > MAX_SEQ_LEN  # tokenized in full, then refused
    one_prompt = time.perf_counter() - started  # what a probe would wait for behind one tokenization
    clients = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
import concurrent.futures, httpx, pathlib
body = pathlib.Path({str(body)!r}).read_bytes()
def post(_):
    return httpx.post({live.url + C!r}, content=body, timeout=120).status_code
with concurrent.futures.ThreadPoolExecutor(8) as pool:
    print(list(pool.map(post, range(8))))
""",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    latencies = []
    with httpx.Client(timeout=10) as probe:
        probe.get(live.url + "/health")  # connection set up outside the timing
        while clients.poll() is None:
            t0 = time.perf_counter()
            assert probe.get(live.url + "/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.01)
    assert clients.stdout.read().strip() == str([400] * 8)
    assert len(latencies) >= 20, "the prompts were tokenized too fast to measure anything"
    # Tokenizing one of these prompts takes about 0.5 s: on the event loop, most probes would wait
    # that long. The 95th percentile, not the maximum, is held to 100 ms: on an overcommitted CI
    # machine the OS alone can delay a single answer past it.
    latencies.sort()
    p95 = latencies[int(0.95 * (len(latencies) - 1))]
    assert p95 < 0.1, f"/health p95 {p95 * 1e3:.0f} ms (max {latencies[-1] * 1e3:.0f} ms) while tokenizing"
    # No probe waited as long as one prompt's tokenization (timed above, on this same machine).
    assert latencies[-1] < max(0.4, one_prompt), f"/health took {latencies[-1] * 1e3:.0f} ms while tokenizing"


# ---------------------------------------------------------------------------- logprobs against an oracle
def _oracle_logprobs(prefix: list[int]) -> np.ndarray:
    """log_softmax of the Hugging Face torch model's next-token logits (an implementation we did not write)."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxllm.models import materialize_preset

    global _HF_MODEL
    if "_HF_MODEL" not in globals():
        _HF_MODEL = AutoModelForCausalLM.from_pretrained(str(materialize_preset(MODEL)), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = _HF_MODEL(torch.tensor([prefix])).logits[0, -1]
    return torch.log_softmax(logits.double(), -1).numpy()


def test_top_logprobs_match_the_model_and_include_the_chosen_token(live, http, client):
    prompt = [5, 6, 7, 8]
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, logprobs=3, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    server = live.app.state.server
    tokenizer = live.executor.tokenizer
    # Completions: the legacy form, keyed by token text.
    prefix = list(prompt)
    for i, top in enumerate(out.logprobs.top_logprobs):
        oracle = _oracle_logprobs(prefix)
        best = np.argsort(-oracle)[:3]
        chosen = int(best[0])  # greedy
        assert out.logprobs.tokens[i] == server.token_text(chosen)
        assert out.logprobs.token_logprobs[i] == pytest.approx(oracle[chosen], abs=2e-3)
        assert server.token_text(chosen) in top, "the greedy token must be among the top logprobs"
        for t in best:
            # Tokens that decode to the same text share a key holding the likelier one's value.
            same_text = [u for u in range(len(oracle)) if server.token_text(u) == server.token_text(int(t))]
            assert top[server.token_text(int(t))] == pytest.approx(max(oracle[u] for u in same_text), abs=2e-3)
        assert len(top) <= 3
        prefix.append(chosen)
    assert len(out.logprobs.top_logprobs) == 3
    # Chat: exactly top_logprobs entries, best first, the greedy token first of them.
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    prefix = tokenizer.encode(prompt_ids, add_special_tokens=False)
    for entry in chat.choices[0].logprobs.content:
        oracle = _oracle_logprobs(prefix)
        best = [int(t) for t in np.argsort(-oracle)[:3]]
        assert len(entry.top_logprobs) == 3
        assert [e.token for e in entry.top_logprobs] == [server.token_text(t) for t in best]
        assert [e.logprob for e in entry.top_logprobs] == pytest.approx([oracle[t] for t in best], abs=2e-3)
        assert entry.token == entry.top_logprobs[0].token and entry.logprob == pytest.approx(oracle[best[0]], abs=2e-3)
        prefix.append(best[0])
    _assert_still_serving(live, http)


def test_completion_prompt_logprobs_match_the_model(live, http):
    """vLLM's prompt_logprobs: None first, then per prompt token the actual token and the top 2."""
    prompt = [5, 6, 7, 8]
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2})
    assert resp.status_code == 200, resp.text
    entries = resp.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    server = live.app.state.server
    for i in range(1, len(prompt)):
        oracle = _oracle_logprobs(prompt[:i])
        best = [int(t) for t in np.argsort(-oracle)[:2]]
        entry = entries[i]
        assert set(entry) == {str(t) for t in best} | {str(prompt[i])}
        for t, value in entry.items():
            assert value["logprob"] == pytest.approx(oracle[int(t)], abs=2e-3)
            assert value["decoded_token"] == server.token_text(int(t))
        assert [entry[str(t)]["rank"] for t in best] == [1, 2]
    _assert_still_serving(live, http)


# ---------------------------------------------------------------------------- cancelled async consumers
def test_cancelled_async_consumer_aborts_its_request(live):
    import asyncio

    llm = LLM.from_executor(live.executor)
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def consume(result):
        async for _ in result:
            pass

    async def run():
        streamed = llm.generate_async("Once upon a time", params, streaming=True)
        task = asyncio.ensure_future(consume(streamed))
        awaited = llm.generate_async("Once upon a time", params)
        waiter = asyncio.ensure_future(awaited.aresult())
        await asyncio.sleep(0.3)
        task.cancel()
        waiter.cancel()
        await asyncio.gather(task, waiter, return_exceptions=True)
        return streamed, awaited

    streamed, awaited = asyncio.run(run())
    for result in (streamed, awaited):
        out = result.result(timeout=30)
        assert out.outputs[0].finish_reason == "cancelled" and len(out.outputs[0].token_ids) < 200
    _wait_idle(live)


def _wait_idle(live, timeout: float = 20.0) -> None:
    wait_idle(live.executor, timeout)


def test_slow_reading_client_is_dropped_and_its_request_aborted(live):
    """A client that stops reading a stream cannot hold its request (and KV blocks) forever.

    Loopback sockets buffer megabytes, so the client is driven at the ASGI level: the
    app's `send` blocks for good after the first chunks, as it does once a real client's
    socket buffers are full."""
    import asyncio

    server = live.app.state.server
    guard = _guard(live.app)
    old = guard.send_timeout
    guard.send_timeout = 1.0
    aborted = server.disconnects
    body = json.dumps(
        {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "stream": True}
    ).encode()
    sent: list[dict] = []
    received: list[bool] = []

    async def receive():
        if not received:
            received.append(True)
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client never hangs up either

    async def send(message):
        sent.append(message)
        if len(sent) > 3:
            await asyncio.Event().wait()  # ... and stops reading

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": C,
        "raw_path": C.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", live.port),
    }
    try:
        started = time.monotonic()
        asyncio.run(asyncio.wait_for(live.app(scope, receive, send), 30))
        assert time.monotonic() - started < 15
    finally:
        guard.send_timeout = old
    assert sent[0]["status"] == 200
    _wait_idle(live, timeout=30)
    assert server.disconnects == aborted + 1, "the stream's request was not aborted"


def _guard(app):
    """The app's GuardMiddleware instance (built when the app first served a request)."""
    layer = app.middleware_stack
    while layer is not None and type(layer).__name__ != "GuardMiddleware":
        layer = getattr(layer, "app", None)
    assert layer is not None
    return layer


# ---------------------------------------------------------------------------- SIGTERM with streams open
def _read_stream(url: str, body: dict, out: dict) -> None:
    events = []
    try:
        with httpx.Client(timeout=120) as c:
            with c.stream("POST", url + C, json=body) as resp:
                out["status"] = resp.status_code
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    out["events"] = events


def test_sigterm_drains_streams_then_aborts_the_rest_and_exits():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxllm",
            "serve",
            MODEL,
            "--port",
            str(port),
            "--max-batch-size",
            "4",
            "--max-num-tokens",
            "16",
            "--max-seq-len",
            "2048",
            "--tokens-per-block",
            "8",
            "--kv-cache-max-tokens",
            "4096",
            "--no-warmup",
            "--shutdown-timeout",
            "4",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        # Compile outside the timed part, so the short stream below surely ends within the timeout.
        assert httpx.post(url + C, json=CANARY, timeout=120).status_code == 200
        short, long = {}, {}
        threads = [
            threading.Thread(target=_read_stream, args=(url, {**CANARY, "stream": True, "max_tokens": 8}, short)),
            threading.Thread(
                target=_read_stream, args=(url, {**CANARY, "stream": True, "max_tokens": 2000, "prompt": "a"}, long)
            ),
        ]
        for t in threads:
            t.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # Admission is closed: new requests get 503 (in OpenAI's shape) while the streams drain.
        refused = httpx.post(url + C, json=CANARY, timeout=10)
        _assert_openai_error(refused, 503, "shutting down")
        for t in threads:
            t.join(60)
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 0
    # The short stream finished normally.
    assert short["events"][-1] == "[DONE]" and json.loads(short["events"][-2])["choices"][0]["finish_reason"]
    # The long one was aborted at the timeout: a final error event, then [DONE] - not a cut connection.
    assert "error" not in long, long
    assert long["events"][-1] == "[DONE]", long["events"][-3:]
    assert json.loads(long["events"][-2]).get("error", {}).get("code") == 503, long["events"][-3:]
