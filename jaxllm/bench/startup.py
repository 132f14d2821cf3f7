"""Time from process start to healthy for `jaxllm serve` (`jaxllm bench startup`).

Starts `jaxllm serve` as a new process and polls `/health` until it answers 200, first
with an empty compilation cache (a fresh directory in `JAX_COMPILATION_CACHE_DIR`) and
then again with the cache that first start filled, which should compile nothing (and, for the
model forwards and samplers in its executable store, trace and lower nothing). The
server's own stderr lines (model load, "compiling ...", "ready in X s") are kept, and the
seconds it reports for loading and compiling are shown next to the total, so the table
says what dominates a cold start. The model itself (downloads, dequantized GGUF) is
resolved once before timing, so neither row pays for a download.

    jaxllm bench startup --model tiny-moe smollm2
    jaxllm bench startup --model smollm2 --serve-args "--max-num-tokens 512 --max-seq-len 2048"
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path


@dataclass
class StartupTiming:
    model: str
    cache: str  # "empty" or "populated"
    healthy_seconds: float  # process start -> /health answers 200
    ready_seconds: float  # the server's own "ready in X s" (engine build + warm-up)
    model_seconds: float  # the server's "model NAME: ... (X s)" line (resolving and loading)
    compile_entries: int  # files in the compilation cache after this start


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


def time_start(model: str, cache_dir: Path, serve_args: list[str], timeout: float, log: Path) -> StartupTiming:
    """Start one server, wait until /health answers, stop it; raises if it dies or times out."""
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
                rows.append(time_start(model, Path(cache_dir), serve_args, args.timeout, log))
                print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    print(format_table(rows))
    print(f"server logs: {logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
