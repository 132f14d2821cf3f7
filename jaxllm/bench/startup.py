"""Time from process start to healthy for `jaxllm serve` (`jaxllm bench startup`).

Starts `jaxllm serve` as a new process and polls `/health` until it answers 200, first
with an empty compilation cache (a fresh directory in `JAX_COMPILATION_CACHE_DIR`) and
then again with the cache that first start filled, which should compile nothing (and, for the
model forwards and samplers in its executable store, trace and lower nothing). The
server's own stderr lines (model load, "compiling ...", "ready in X s") are kept, and the
seconds it reports for loading and compiling are shown next to the total, so the table
says what dominates a cold start. The model itself (downloads, dequantized GGUF) is
resolved once before timing, so neither row pays for a download.

Then, on the same server, the first `--requests` streamed completions (prompts of several
lengths, sent at once) right after "ready", and the same requests again `--settle` seconds
later (prompts of the same lengths and another word, so no KV block of the first ones is reused),
once the programs a background warm-up leaves for idle time have compiled: their TTFTs side by
side say what a user arriving at "ready" pays for an early ready.

    jaxllm bench startup --model tiny-moe smollm2
    jaxllm bench startup --model smollm2 --serve-args "--max-num-tokens 512 --max-seq-len 2048"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class StartupTiming:
    model: str
    cache: str  # "empty" or "populated"
    healthy_seconds: float  # process start -> /health answers 200
    ready_seconds: float  # the server's own "ready in X s" (engine build + warm-up)
    model_seconds: float  # the server's "model NAME: ... (X s)" line (resolving and loading)
    compile_entries: int  # files in the compilation cache after this start
    ttft_ready: list[float] = field(default_factory=list)  # seconds, the first requests right after ready
    ttft_settled: list[float] = field(default_factory=list)  # the same requests once settled


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def _seconds(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    return float(match.group(1)) if match else float("nan")


# Prompt lengths (words) of the first requests: short chat turns and a few longer ones, so they
# need token buckets a background warm-up has not compiled yet.
PROMPT_WORDS = (6, 20, 45, 90, 180, 360, 12, 30)


def first_request_prompts(num: int, word: str = "hello") -> list[str]:
    """`num` prompts of `PROMPT_WORDS` words each, `word` repeated: the later burst takes another
    word, so its prompts share no KV block with the first burst's (prefix reuse would make the
    later burst cheaper for a reason that has nothing to do with start-up)."""
    return [" ".join([word] * PROMPT_WORDS[i % len(PROMPT_WORDS)]) for i in range(num)]


def _ttft(base: str, prompt: str, max_tokens: int = 8) -> float:
    """Seconds until the first streamed chunk of one completion (raises on a failed request)."""
    body = {"model": _served_model(base), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    request = urllib.request.Request(
        f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    first = None
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("a streamed completion returned no chunk")
    return first


def _served_model(base: str) -> str:
    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as response:
        return json.loads(response.read())["data"][0]["id"]


def first_ttfts(base: str, prompts: list[str]) -> list[float]:
    """TTFT of each prompt, all sent at once (one thread each)."""
    out: list[float] = [float("nan")] * len(prompts)

    def one(i: int) -> None:
        out[i] = _ttft(base, prompts[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def time_start(
    model: str,
    cache_dir: Path,
    serve_args: list[str],
    timeout: float,
    log: Path,
    requests: int = 0,
    settle: float = 60.0,
) -> StartupTiming:
    """Start one server, wait until /health answers, time the first `requests` completions then
    and `settle` seconds later, stop it; raises if it dies or times out."""
    port = _free_port()
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache_dir), JAXLLM_COMPILE_CACHE="1")
    cmd = [sys.executable, "-m", "jaxllm", "serve", "--model", model, "--port", str(port), *serve_args]
    url = f"http://127.0.0.1:{port}/health"
    cache = "populated" if any(cache_dir.rglob("*")) else "empty"
    with open(log, "w", encoding="utf-8") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            while not _healthy(url):
                if proc.poll() is not None:
                    raise RuntimeError(f"jaxllm serve exited with status {proc.returncode}; see {log}")
                if time.perf_counter() - start > timeout:
                    raise RuntimeError(f"jaxllm serve was not healthy within {timeout:.0f} s; see {log}")
                time.sleep(0.05)
            healthy = time.perf_counter() - start
            ttft_ready, ttft_settled = [], []
            if requests:
                base = url.removesuffix("/health")
                ttft_ready = first_ttfts(base, first_request_prompts(requests))
                time.sleep(settle)
                ttft_settled = first_ttfts(base, first_request_prompts(requests, "world"))
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    text = log.read_text(encoding="utf-8", errors="replace")
    return StartupTiming(
        model,
        cache,
        healthy,
        _seconds(r"ready in ([0-9.]+) s", text),
        _seconds(r"(?m)^model .*\(([0-9.]+) s\)\s*$", text),
        sum(1 for p in cache_dir.rglob("*") if p.is_file()),
        ttft_ready,
        ttft_settled,
    )


def format_table(rows: list[StartupTiming]) -> str:
    header = (
        f"{'model':<12} {'compile cache':<13} {'healthy s':>9} {'ready in s':>10} {'model load s':>12} "
        f"{'cache files':>11}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.model:<12} {r.cache:<13} {r.healthy_seconds:>9.1f} {r.ready_seconds:>10.1f} "
            f"{r.model_seconds:>12.1f} {r.compile_entries:>11}"
        )
    return "\n".join(lines)


def format_ttft_table(rows: list[StartupTiming], settle: float) -> str:
    """TTFT (ms) of the first requests right after ready and `settle` s later, per start."""
    header = (
        f"{'model':<12} {'compile cache':<13} {'n':>3} {'ready p50':>9} {'ready max':>9} "
        f"{'+' + format(settle, '.0f') + ' s p50':>10} {'max':>8} {'p50 ratio':>9}"
    )
    lines = ["TTFT ms of the first requests (sent at once) right after ready and later", header, "-" * len(header)]
    for r in rows:
        if not r.ttft_ready:
            continue
        ready, later = np.asarray(r.ttft_ready) * 1e3, np.asarray(r.ttft_settled) * 1e3
        lines.append(
            f"{r.model:<12} {r.cache:<13} {len(ready):>3} {np.median(ready):>9.0f} {ready.max():>9.0f} "
            f"{np.median(later):>10.0f} {later.max():>8.0f} {np.median(ready) / np.median(later):>9.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from jaxllm.cli.args import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="jaxllm bench startup",
        formatter_class=HelpFormatter,
        description="Seconds from starting `jaxllm serve` to a healthy /health, with an empty and with a "
        "populated compilation cache.",
    )
    parser.add_argument("--model", nargs="+", default=["tiny-moe", "smollm2"])
    parser.add_argument("--serve-args", default="", help="extra `jaxllm serve` flags, one shell-quoted string")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for one start")
    parser.add_argument("--logs", default=None, help="directory for the servers' stderr (default: a temporary one)")
    parser.add_argument("--requests", type=int, default=8, help="first requests timed after ready (0: none)")
    parser.add_argument("--settle", type=float, default=60.0, help="seconds before the same requests run again")
    args = parser.parse_args(argv)
    serve_args = shlex.split(args.serve_args)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="jaxllm-startup-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    rows = []
    from jaxllm.models.resolve import resolve_model

    for model in args.model:
        resolve_model(model)  # download / dequantize once, outside the timings
        with tempfile.TemporaryDirectory(prefix="jaxllm-startup-xla-") as cache_dir:
            for attempt in ("empty", "populated"):
                log = logs / f"{model.replace('/', '_')}-{attempt}.log"
                rows.append(
                    time_start(model, Path(cache_dir), serve_args, args.timeout, log, args.requests, args.settle)
                )
                print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    print(format_table(rows))
    if args.requests:
        print(format_ttft_table(rows, args.settle))
    print(f"server logs: {logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
