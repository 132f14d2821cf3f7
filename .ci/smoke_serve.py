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
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise SystemExit(f"server exited with {server.returncode} before it was ready")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("server not ready within 300 s")
            time.sleep(0.5)
        body = json.dumps(
            {
                "model": "tiny-moe",
                "messages": [{"role": "user", "content": "Hello!"}],
                "max_tokens": 8,
                "ignore_eos": True,
            }
        ).encode()
        request = urllib.request.Request(
            url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            reply = json.loads(response.read())
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
