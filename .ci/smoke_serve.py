"""Smoke test of a base install (no test extra): serve tiny-moe, answer one chat completion.

Run with the fresh virtual environment's Python by .ci/run, so a runtime dependency missing
from pyproject.toml fails here. Standard library only on the client side.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, what: str, log=None) -> float:
    """Seconds until `url`/health answers 200; SystemExit if `proc` ends first or time runs out
    (with the tail of `log`, a Path, when given)."""
    started = time.monotonic()
    tail = (lambda: "\n" + log.read_text()[-4000:]) if log is not None else (lambda: "")
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode} before it was ready{tail()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - started
        except OSError:
            pass
        if time.monotonic() - started > timeout:
            raise SystemExit(f"{what} not ready within {timeout:.0f} s{tail()}")
        time.sleep(0.5)


def post_json(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def main() -> int:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "jaxllm",
        "serve",
        "--model",
        "tiny-moe",
        "--port",
        str(port),
        "--max-batch-size",
        "2",
        "--max-num-tokens",
        "16",
        "--max-seq-len",
        "128",
        "--kv-cache-max-tokens",
        "512",
        "--tokens-per-block",
        "8",
        "--no-warmup",
        "--log-level",
        "warning",
    ]
    server = subprocess.Popen(cmd, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        wait_healthy(url, server, 300, what="server")
        reply = post_json(
            url + "/v1/chat/completions",
            {
                "model": "tiny-moe",
                "messages": [{"role": "user", "content": "Hello!"}],
                "max_tokens": 8,
                "ignore_eos": True,
            },
        )
        choice = reply["choices"][0]
        assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length", reply
        assert reply["usage"]["completion_tokens"] == 8, reply
        with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
            metrics = response.read().decode()
        assert "jaxllm:generation_tokens_total" in metrics, metrics[:500]
        print(f"smoke: chat completion from a base install OK ({reply['usage']})")
        return 0
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    raise SystemExit(main())
