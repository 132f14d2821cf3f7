"""Disaggregated serving of an MLA model (a tiny random DeepSeek-V3) on real worker processes:
a context worker at TP 1, a generation worker at TP 2 (two CPU devices) pulling the latent
blocks device to device (`backend: TRANSFER`, `jax.experimental.transfer`), and the router.
Answers through the router - greedy and streamed, chat, `n > 1` with a seed, logprobs - must
equal what the context worker answers as an ordinary (aggregated) server, and both KV pools
end at their starting free block counts.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from test_disaggregated import _assert_pools_back, _env, _free_blocks, _metric, _wait_healthy

from tests.multidevice import FAST_COMPILE

from server_helpers import free_port

FLAGS = [
    "--max-batch-size", "4", "--max-num-tokens", "16", "--max-seq-len", "128", "--tokens-per-block", "8",
    "--kv-cache-max-tokens", "1024", "--decode-batch-sizes", "off", "--log-level", "warning",
]  # fmt: skip
PROMPTS = [f"tale {i}: a fox and a crow " * (1 + i % 3) for i in range(4)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from test_deepseek import ENGINE, write_checkpoint

    tmp = tmp_path_factory.mktemp("disagg_mla")
    model = tmp / "ds"
    # One MLA layer (no MoE layer: what is handed over is the latent cache); the tokenizer's 453 ids fit.
    write_checkpoint(model, dict(ENGINE, vocab_size=512, num_hidden_layers=1), seed=3, tokenizer=True)
    procs, urls = {}, {}
    try:
        for name, tp, backend in (("ctx", 1, "DEFAULT"), ("gen", 2, "TRANSFER")):
            (tmp / f"{name}.yaml").write_text(f"cache_transceiver_config:\n  backend: {backend}\n")
            port = free_port()
            cmd = [sys.executable, "-m", "jaxllm", "serve", "--model", str(model), "--port", str(port)]
            cmd += ["--config", str(tmp / f"{name}.yaml"), "--tensor-parallel-size", str(tp), *FLAGS]
            env = _env(XLA_FLAGS=f"--xla_force_host_platform_device_count={tp} {FAST_COMPILE}")  # both workers
            log = open(tmp / f"{name}.log", "w")
            procs[name] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            urls[name] = f"http://127.0.0.1:{port}"
        for name in procs:
            _wait_healthy(procs[name], urls[name], tmp / f"{name}.log")
        port = free_port()
        config = {
            "hostname": "127.0.0.1",
            "port": port,
            "context_servers": {"urls": [urls["ctx"]]},
            "generation_servers": {"urls": [urls["gen"]]},
        }
        (tmp / "disagg.yaml").write_text(json.dumps(config))
        log = open(tmp / "router.log", "w")
        procs["router"] = subprocess.Popen(
            [sys.executable, "-m", "jaxllm", "disaggregated", "-c", str(tmp / "disagg.yaml"), "--log-level", "warning"],
            env=_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        urls["router"] = f"http://127.0.0.1:{port}"
        _wait_healthy(procs["router"], urls["router"], tmp / "router.log", timeout=60)
        start = {name: _free_blocks(urls[name]) for name in ("ctx", "gen")}
        yield {"urls": urls, "start": start, "model": str(model)}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_mla_tp1_to_tp2_over_device_transfer_equals_aggregated(cluster):
    urls, model = cluster["urls"], cluster["model"]

    def complete(url: str, prompt: str, stream: bool) -> str:
        answer = _client(url).completions.create(
            model=model, prompt=prompt, max_tokens=10, temperature=0, stream=stream
        )
        if stream:
            return "".join(c.choices[0].text for c in answer if c.choices)
        return answer.choices[0].text

    with cf.ThreadPoolExecutor(4) as pool:
        want = list(pool.map(lambda p: complete(urls["ctx"], p, False), PROMPTS))
        got = list(pool.map(lambda p: complete(urls["router"], p, False), PROMPTS))
        streamed = list(pool.map(lambda p: complete(urls["router"], p, True), PROMPTS))
    assert got == want and streamed == want
    assert all(want)
    messages = [{"role": "user", "content": "a fox met a crow"}]
    chat = [
        _client(url).chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        for url in (urls["ctx"], urls["router"])
    ]
    assert chat[1].choices[0].message.content == chat[0].choices[0].message.content
    name = f'jaxllm:kv_transfer_requests_total{{backend="TRANSFER",model_name="{model}"}}'
    assert _metric(urls["gen"], name) >= len(PROMPTS) * 2 + 1
    _assert_pools_back(cluster, ("ctx", "gen"))


def _choices(answer) -> list[tuple[str, list, list]]:
    return [(c.text, c.logprobs.tokens, c.logprobs.top_logprobs) for c in answer.choices]


def test_n_with_a_seed_and_logprobs_through_the_router_equal_aggregated(cluster):
    urls, model = cluster["urls"], cluster["model"]
    args = dict(model=model, prompt=PROMPTS[1], max_tokens=8, temperature=0.9, seed=11, n=3, logprobs=2)
    want, got = (_client(urls[n]).completions.create(**args) for n in ("ctx", "router"))
    assert len({c.text for c in want.choices}) > 1, "the sequences should differ"
    for (w_text, w_tokens, w_top), (g_text, g_tokens, g_top) in zip(_choices(want), _choices(got), strict=True):
        assert (g_text, g_tokens) == (w_text, w_tokens)
        for w, g in zip(w_top, g_top, strict=True):  # the first token's come from the context worker
            assert w.keys() == g.keys()
            assert all(g[t] == pytest.approx(w[t], abs=1e-4) for t in w)
    assert got.usage == want.usage
    # Streamed: each choice's text, re-numbered 0..n-1, and one usage chunk for the whole request.
    stream = _client(urls["router"]).completions.create(
        **dict(args, logprobs=None), stream=True, stream_options={"include_usage": True}
    )
    texts, usages = ["", "", ""], []
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
        if chunk.usage:
            usages.append(chunk.usage)
    assert texts == [c.text for c in want.choices]
    assert len(usages) == 1 and usages[0].completion_tokens == want.usage.completion_tokens
    # Chat: top logprobs of every token, the first one's carried over from the context worker.
    messages = [{"role": "user", "content": "the crow sang"}]
    chat_args = dict(model=model, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    want_chat, got_chat = (_client(urls[n]).chat.completions.create(**chat_args) for n in ("ctx", "router"))
    w_lp, g_lp = want_chat.choices[0].logprobs.content, got_chat.choices[0].logprobs.content
    assert [t.token for t in g_lp] == [t.token for t in w_lp] and len(w_lp) == 6
    for w, g in zip(w_lp, g_lp):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [t.token for t in g.top_logprobs] == [t.token for t in w.top_logprobs]
    chat_n = dict(model=model, messages=messages, max_tokens=6, temperature=0.9, seed=5, n=2)
    want_n, got_n = (_client(urls[n]).chat.completions.create(**chat_n) for n in ("ctx", "router"))
    assert [c.message.content for c in got_n.choices] == [c.message.content for c in want_n.choices]
    assert [c.index for c in got_n.choices] == [0, 1] and got_n.usage == want_n.usage
    # Refused with the field named: best_of above n, beam search.
    for extra, param in (({"n": 2, "best_of": 3}, "best_of"), ({"n": 2, "use_beam_search": True}, "use_beam_search")):
        answer = httpx.post(
            urls["router"] + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 3, **extra}
        )
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    _assert_pools_back(cluster, ("ctx", "gen"))
