"""Disaggregated prefill and decode on real worker processes: one context worker (TP 1), two
generation workers (TP 1 and TP 2, on two CPU devices) and the `jaxllm disaggregated` router,
started once for the module. Greedy answers through the router must equal the ones an
ordinary (aggregated) request gets from a worker, under concurrent requests, streamed or not,
for completions and chat; each failure case ends with the KV pools back at their starting
free block counts (`jaxllm:kv_cache_free_blocks` in /metrics).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.multidevice import FAST_COMPILE

from server_helpers import free_port

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-dense"
TIMEOUT_MS = 3000  # kv_transfer_timeout_ms of the workers
WORKER_FLAGS = [
    "--max-batch-size", "8", "--max-num-tokens", "16", "--max-seq-len", "1024", "--tokens-per-block", "8",
    "--kv-cache-max-tokens", "2048", "--decode-batch-sizes", "off", "--log-level", "warning",
]  # fmt: skip
PROMPTS = [f"story {i}: once upon a time there was " * (1 + i % 5) for i in range(8)]


def _env(**extra: str) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", **extra)


def _start_worker(tmp: Path, name: str, tp: int, backend: str = "DEFAULT") -> tuple[subprocess.Popen, str]:
    config = tmp / f"{name}.yaml"
    config.write_text(f"cache_transceiver_config:\n  backend: {backend}\n  kv_transfer_timeout_ms: {TIMEOUT_MS}\n")
    port = free_port()
    # Every worker compiles with the same flags (their answers are compared with each other's).
    env = _env(XLA_FLAGS=f"--xla_force_host_platform_device_count={tp} {FAST_COMPILE}")
    cmd = [sys.executable, "-m", "jaxllm", "serve", "--model", MODEL, "--port", str(port), "--config", str(config)]
    cmd += WORKER_FLAGS + ["--tensor-parallel-size", str(tp)]
    log = open(tmp / f"{name}.log", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{url} exited: {log.read_text()[-3000:]}"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{url} did not become healthy: {log.read_text()[-3000:]}")


class DroppingWorker:
    """Stands in for a context worker that dies once it has a request: /health answers 200,
    any POST has its connection closed without an answer."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.posts = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                head = conn.recv(65536)
                if head.startswith(b"GET /health"):
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                else:
                    self.posts += 1

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disagg")
    procs = {}
    urls = {}
    dropping = DroppingWorker()
    router = None
    try:
        # gen1 runs the programs ctx compiled: started once ctx is up, it loads them from the
        # test session's compilation cache.
        for name, tp in (("ctx", 1), ("gen2", 2)):
            procs[name], urls[name] = _start_worker(tmp, name, tp)
        _wait_healthy(procs["ctx"], urls["ctx"], tmp / "ctx.log")
        procs["gen1"], urls["gen1"] = _start_worker(tmp, "gen1", 1, backend="TCP")
        for name in ("gen2", "gen1"):
            _wait_healthy(procs[name], urls[name], tmp / f"{name}.log")
        port = free_port()
        config = {
            "hostname": "127.0.0.1",
            "port": port,
            "context_servers": {"num_instances": 2, "urls": [dropping.url, urls["ctx"].removeprefix("http://")]},
            "generation_servers": {"num_instances": 2, "urls": [urls["gen1"], urls["gen2"]]},
            "health_check_interval_s": 0.5,
        }
        (tmp / "disagg.yaml").write_text(json.dumps(config))
        log = open(tmp / "router.log", "w")
        router = subprocess.Popen(
            [sys.executable, "-m", "jaxllm", "disaggregated", "-c", str(tmp / "disagg.yaml"), "--log-level", "warning"],
            env=_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        urls["router"] = f"http://127.0.0.1:{port}"
        _wait_healthy(router, urls["router"], tmp / "router.log", timeout=60)
        start = {name: _free_blocks(urls[name]) for name in ("ctx", "gen1", "gen2")}
        yield {"urls": urls, "procs": procs, "start": start, "dropping": dropping, "tmp": tmp}
    finally:
        dropping.close()
        for proc in [*procs.values(), router]:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in [*procs.values(), router]:
            if proc is not None:
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert match, f"{name} not in {url}/metrics"
    return float(match.group(1))


def _free_blocks(url: str) -> float:
    return _metric(url, "jaxllm:kv_cache_free_blocks")


def _assert_pools_back(cluster, names=("ctx", "gen1", "gen2"), timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        now = {n: _free_blocks(cluster["urls"][n]) for n in names}
        want = {n: cluster["start"][n] for n in names}
        if now == want:
            return
        assert time.monotonic() < deadline, f"KV pools not back at their start: {now} != {want}"
        time.sleep(0.2)


def _complete(url: str, prompt: str, stream: bool, max_tokens: int = 12) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    if stream:
        chunks = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in chunks if c.choices)
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text


def test_router_answers_equal_aggregated_serving_under_concurrency(cluster):
    urls = cluster["urls"]
    with cf.ThreadPoolExecutor(8) as pool:
        want = list(pool.map(lambda p: _complete(urls["gen1"], p, False), PROMPTS))
        got = list(pool.map(lambda p: _complete(urls["router"], p, False), PROMPTS))
        streamed = list(pool.map(lambda p: _complete(urls["router"], p, True), PROMPTS))
    assert got == want
    assert streamed == want
    # Both generation workers took requests: TP 1 -> TP 1 over TCP, TP 1 -> TP 2 through shared memory.
    for name, backend in (("gen1", "TCP"), ("gen2", "SHM")):
        assert _metric(urls[name], f'jaxllm:kv_transfer_requests_total{{backend="{backend}",model_name="{MODEL}"}}') > 0
    client = openai.OpenAI(base_url=urls["router"] + "/v1", api_key="unused", max_retries=0)
    direct = openai.OpenAI(base_url=urls["gen2"] + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "tell me a story about a fox"}]
    want_chat = direct.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    got_chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert got_chat.choices[0].message.content == want_chat.choices[0].message.content
    assert got_chat.usage.completion_tokens == want_chat.usage.completion_tokens == 10
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True)
    assert (
        "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want_chat.choices[0].message.content
    )
    # max_tokens=1: answered by the context worker alone.
    assert _complete(urls["router"], PROMPTS[0], False, max_tokens=1) == _complete(urls["gen1"], PROMPTS[0], False, 1)
    _assert_pools_back(cluster)


def test_context_worker_dying_before_hand_over_is_retried(cluster):
    urls = cluster["urls"]
    before = cluster["dropping"].posts
    # New prompts: none has a prefix routed before, so load (equal: in turn) spreads them.
    prompts = [f"retry {i}. " + p for i, p in enumerate(PROMPTS[:4])]
    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: _complete(urls["router"], p, False), prompts))
    assert got == [_complete(urls["gen1"], p, False) for p in prompts]
    assert cluster["dropping"].posts > before, "no request reached the dying context worker"
    assert _metric(urls["router"], 'jaxllm:disagg_retries_total{phase="context"}') >= 1
    _assert_pools_back(cluster)


def test_unclaimed_handle_is_freed_after_the_timeout(cluster):
    url = cluster["urls"]["ctx"]
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 5, "temperature": 0}
    answer = httpx.post(
        url + "/v1/completions", json={**body, "disaggregated_params": {"request_type": "context_only"}}
    )
    handle = answer.json()["choices"][0]["disaggregated_params"]
    assert handle["opaque_state"] and handle["ctx_info_endpoint"].startswith("tcp://")
    assert _metric(url, "jaxllm:kv_transfer_held_requests") == 1
    assert _free_blocks(url) < cluster["start"]["ctx"]
    _assert_pools_back(cluster, ("ctx",), timeout=TIMEOUT_MS / 1e3 + 5)
    assert _metric(url, "jaxllm:kv_transfer_held_requests") == 0
    late = httpx.post(
        cluster["urls"]["gen1"] + "/v1/completions",
        json={**body, "disaggregated_params": dict(handle, request_type="generation_only")},
    )
    assert late.status_code == 502 and "not held here" in late.json()["error"]["message"]


class CuttingProxy:
    """Forwards a KV claim to the context worker and only the first `limit` bytes back."""

    def __init__(self, target: tuple[str, int], limit: int) -> None:
        self.target, self.limit = target, limit
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn, socket.create_connection(self.target) as upstream:
            upstream.sendall(conn.recv(4096))
            sent = 0
            while sent < self.limit:
                data = upstream.recv(min(65536, self.limit - sent))
                if not data:
                    break
                conn.sendall(data)
                sent += len(data)
        self.sock.close()


def test_transfer_cut_half_way_fails_the_request_not_the_worker(cluster):
    urls = cluster["urls"]
    body = {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": 6, "temperature": 0}
    answer = httpx.post(
        urls["ctx"] + "/v1/completions", json={**body, "disaggregated_params": {"request_type": "context_only"}}
    ).json()
    handle = answer["choices"][0]["disaggregated_params"]
    host, port = handle["ctx_info_endpoint"].removeprefix("tcp://").rsplit(":", 1)
    proxy = CuttingProxy((host, int(port)), limit=3000)
    cut = httpx.post(
        urls["gen1"] + "/v1/completions",
        json={
            **body,
            "disaggregated_params": dict(handle, request_type="generation_only", ctx_info_endpoint=proxy.endpoint),
        },
    )
    assert cut.status_code == 502, cut.text
    assert "was cut" in cut.json()["error"]["message"]
    assert _complete(urls["gen1"], PROMPTS[4], False, 6) == _complete(urls["router"], PROMPTS[4], False, 6)
    _assert_pools_back(cluster)


def test_generation_worker_dying_fails_its_requests_and_the_router_serves_on(cluster):
    urls = cluster["urls"]
    client = openai.OpenAI(base_url=urls["router"] + "/v1", api_key="unused", max_retries=0)
    streams = [
        client.completions.create(
            model=MODEL, prompt=p, max_tokens=900, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        for p in PROMPTS[:2]
    ]
    firsts = [next(iter(s)) for s in streams]
    assert all(f.choices for f in firsts)
    cluster["procs"]["gen2"].kill()
    cluster["procs"]["gen2"].wait(10)
    outcomes = []
    for stream in streams:
        try:
            for _ in stream:
                pass
            outcomes.append("ok")
        except openai.APIError as exc:
            outcomes.append(f"error: {exc}")
    assert sorted(o[:5] for o in outcomes) == ["error", "ok"], outcomes
    # The router serves on through the other generation worker.
    with cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: _complete(urls["router"], p, False), PROMPTS[:4]))
    assert got == [_complete(urls["gen1"], p, False) for p in PROMPTS[:4]]
    _assert_pools_back(cluster, ("ctx", "gen1"))


def test_context_workers_by_longest_routed_prefix_else_by_load():
    from jaxllm.server.disagg_prefix import block_hashes
    from jaxllm.server.disagg_router import WorkerPool

    pool = WorkerPool("context", [f"http://w{i}:1" for i in range(3)])

    def route(text: str):
        hashes = block_hashes(text)
        worker = pool.candidates(set(), hashes)[0]
        pool.prefixes.insert(worker.url, hashes)
        return worker

    # Prompts with nothing in common are spread by load (equal here: in turn).
    assert len({route(f"question {i}: " + "why is the sky blue? " * 8).url for i in range(3)}) == 3
    system = "You are a helpful assistant who answers briefly. " * 12  # 9 full blocks of 64 characters
    home = route(system + "question 0")
    assert all(route(system + f"question {i}") is home for i in range(1, 6))
    # The longest prefix wins: another worker was sent a longer part of this prompt.
    other = next(w for w in pool.workers if w is not home)
    document = system + "Here is a long document about foxes and crows. " * 10
    pool.prefixes.insert(other.url, block_hashes(document))
    assert pool.candidates(set(), block_hashes(document + "summarize it"))[0] is other
    assert pool.candidates(set(), block_hashes(system + "question 9"))[0] in (home, other)
    # Busier than the least loaded by more than the slack, or down: load decides instead.
    home.in_flight = other.in_flight = WorkerPool.PREFIX_SLACK + 1
    third = next(w for w in pool.workers if w not in (home, other))
    assert pool.candidates(set(), block_hashes(system + "question 1"))[0] is third
    home.in_flight = other.in_flight = 0
    home.up = other.up = False
    assert pool.candidates(set(), block_hashes(system + "question 1"))[0] is third
    assert pool.candidates(set(), block_hashes(system))[-1] in (home, other)  # a worker marked down is tried last
    # A prompt shorter than one block has no prefix to keep.
    assert block_hashes("short") == []


def test_router_api_key_health_and_no_workers():
    """The API key guards /v1/ as on `jaxllm serve`; with no reachable worker /health is 503 and a
    request gets a 503 in OpenAI's error shape; a client may not set disaggregated_params."""
    from fastapi.testclient import TestClient

    from jaxllm.server.disagg_config import DisaggConfig
    from jaxllm.server.disagg_router import build_router_app

    dead = f"127.0.0.1:{free_port()}"
    config = DisaggConfig.from_dict(
        {"context_servers": {"urls": [dead]}, "generation_servers": {"urls": [dead]}, "api_key": "k"}
    )
    with TestClient(build_router_app(config)) as client:
        assert client.get("/health").status_code == 503
        body = {"model": MODEL, "prompt": "hi"}
        assert client.post("/v1/completions", json=body).status_code == 401
        auth = {"Authorization": "Bearer k"}
        answer = client.post("/v1/completions", json=body, headers=auth)
        assert (
            answer.status_code == 503
            and answer.json()["error"]["message"] == "no context worker could take the request"
        )
        refused = client.post(
            "/v1/completions", json={**body, "disaggregated_params": {"request_type": "context_only"}}, headers=auth
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "disaggregated_params"
        assert "jaxllm:disagg_worker_up" in client.get("/metrics").text
