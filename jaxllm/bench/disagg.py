"""Disaggregated vs aggregated serving: inter-token latency of decoding requests while long
prompts keep arriving (`jaxllm bench disagg`).

Starts real processes: one aggregated worker (`jaxllm serve`), and a context worker, a
generation worker and the `jaxllm disaggregated` router; then runs the same workload against
the aggregated worker and against the router, one after the other:
  * `--decode-streams` streamed requests of `--decode-prompt-len` tokens and `--decode-len`
    output tokens (greedy, EOS ignored), whose inter-token latencies are recorded;
  * meanwhile a prompt of `--long-len` tokens (`--long-output-len` output tokens) arrives every
    `--long-interval` seconds.
Columns: ITL p50 / p99 of the decoding streams and their ratio to aggregated, the long prompts'
end-to-end latency p50, and per hand-over the time to pull the blocks and their size (the
generation worker's `jaxllm:kv_transfer_seconds` / `_bytes`). The answers of the two modes are
compared token for token. Every worker has the same limits and is warmed up.

On one host the two layouts share the machine's cores (CPU) or need a device each: set
`--context-devices` / `--generation-devices` (CUDA_VISIBLE_DEVICES of each worker).

    jaxllm bench disagg --model tiny-dense
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np


@dataclass
class ModeRow:
    mode: str
    itls_ms: list[float] = field(default_factory=list)
    long_ms: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    transfer_ms: Optional[float] = None
    transfer_kib: Optional[float] = None

    def itl(self, q: float) -> float:
        return float(np.percentile(self.itls_ms, q)) if self.itls_ms else float("nan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(args, name: str, tmp: Path, transceiver: bool, devices: Optional[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "jaxllm", "serve", "--model", args.model, "--port", str(port)]
    cmd += ["--max-batch-size", str(args.max_batch_size), "--max-num-tokens", str(args.max_num_tokens)]
    cmd += ["--max-seq-len", str(args.max_seq_len), "--log-level", "warning"]
    if transceiver:
        config = tmp / f"{name}.yaml"
        config.write_text(f"cache_transceiver_config:\n  backend: {args.backend}\n")
        cmd += ["--config", str(config)]
    env = dict(os.environ)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    log = open(tmp / f"{name}.log", "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def _wait(proc: subprocess.Popen, url: str, log: Path, timeout: float = 900) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not become healthy within {timeout:.0f}s")


async def _decode_stream(client, url: str, body: dict, row: ModeRow) -> str:
    text, last = [], None
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            now = time.perf_counter()
            if last is not None:
                row.itls_ms.append((now - last) * 1e3)
            last = now
            text.append("".join(c.get("text", "") for c in event.get("choices", [])))
    return "".join(text)


async def _long_prompt(client, url: str, body: dict, row: ModeRow) -> str:
    started = time.perf_counter()
    response = await client.post(url + "/v1/completions", json=body)
    response.raise_for_status()
    row.long_ms.append((time.perf_counter() - started) * 1e3)
    return response.json()["choices"][0]["text"]


async def _run_mode(args, mode: str, url: str, model: str) -> ModeRow:
    import httpx

    rng = np.random.default_rng(args.seed)
    row = ModeRow(mode)
    common = {"model": model, "temperature": 0, "ignore_eos": True}
    decode = [
        dict(
            common,
            prompt=rng.integers(10, 200, args.decode_prompt_len).tolist(),
            max_tokens=args.decode_len,
            stream=True,
        )
        for _ in range(args.decode_streams)
    ]
    longs = [
        dict(common, prompt=rng.integers(10, 200, args.long_len).tolist(), max_tokens=args.long_output_len)
        for _ in range(args.num_long)
    ]
    async with httpx.AsyncClient(timeout=600) as client:
        streams = [asyncio.ensure_future(_decode_stream(client, url, body, row)) for body in decode]
        await asyncio.sleep(args.long_interval)
        long_tasks = []
        for body in longs:
            long_tasks.append(asyncio.ensure_future(_long_prompt(client, url, body, row)))
            await asyncio.sleep(args.long_interval)
        row.texts = list(await asyncio.gather(*streams)) + list(await asyncio.gather(*long_tasks))
    return row


def _metric_sum(url: str, name: str) -> float:
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def format_table(rows: list[ModeRow]) -> str:
    head = (
        f"{'mode':<14} {'ITL p50 ms':>10} {'ITL p99 ms':>10} {'p50 vs agg':>10} {'p99 vs agg':>10} "
        f"{'long p50 ms':>11} {'transfer ms/req':>15} {'KV KiB/req':>10}"
    )
    lines = [head, "-" * len(head)]
    base = rows[0]
    for r in rows:
        transfer = "-" if r.transfer_ms is None else f"{r.transfer_ms:.2f}"
        kib = "-" if r.transfer_kib is None else f"{r.transfer_kib:.1f}"
        long_p50 = float(np.percentile(r.long_ms, 50)) if r.long_ms else float("nan")
        lines.append(
            f"{r.mode:<14} {r.itl(50):>10.2f} {r.itl(99):>10.2f} {r.itl(50) / base.itl(50):>9.2f}x "
            f"{r.itl(99) / base.itl(99):>9.2f}x {long_p50:>11.1f} {transfer:>15} {kib:>10}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from jaxllm.cli.args import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="jaxllm bench disagg",
        formatter_class=HelpFormatter,
        description="ITL p50/p99 of decoding requests while long prompts arrive: one aggregated worker vs a "
        "context worker + generation worker behind `jaxllm disaggregated`, side by side; transfer time per request.",
    )
    parser.add_argument("--model", default="tiny-dense")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-num-tokens", type=int, default=512)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--decode-streams", type=int, default=8)
    parser.add_argument("--decode-prompt-len", type=int, default=16)
    parser.add_argument("--decode-len", type=int, default=256)
    parser.add_argument("--num-long", type=int, default=8)
    parser.add_argument("--long-len", type=int, default=1024)
    parser.add_argument("--long-output-len", type=int, default=4)
    parser.add_argument("--long-interval", type=float, default=0.2, help="seconds between long prompts")
    parser.add_argument("--context-devices", default=None, help="CUDA_VISIBLE_DEVICES of the context worker")
    parser.add_argument("--generation-devices", default=None, help="CUDA_VISIBLE_DEVICES of the generation worker")
    parser.add_argument("--aggregated-devices", default=None, help="CUDA_VISIBLE_DEVICES of the aggregated worker")
    parser.add_argument(
        "--backend",
        default="DEFAULT",
        choices=["DEFAULT", "TCP", "SHM", "TRANSFER"],
        metavar="BACKEND",
        help="the workers' cache transceiver: TCP, SHM, TRANSFER (device to device), or the best one (%(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.long_len + args.long_output_len > args.max_seq_len:
        parser.error("--long-len + --long-output-len must fit --max-seq-len")

    tmp = Path(tempfile.mkdtemp(prefix="jaxllm-bench-disagg-"))
    procs: list[subprocess.Popen] = []
    try:
        agg, agg_url = _worker(args, "aggregated", tmp, False, args.aggregated_devices)
        ctx, ctx_url = _worker(args, "context", tmp, True, args.context_devices)
        gen, gen_url = _worker(args, "generation", tmp, True, args.generation_devices)
        procs += [agg, ctx, gen]
        for proc, url, name in ((agg, agg_url, "aggregated"), (ctx, ctx_url, "context"), (gen, gen_url, "generation")):
            _wait(proc, url, tmp / f"{name}.log")
        router_port = _free_port()
        config = {
            "hostname": "127.0.0.1",
            "port": router_port,
            "context_servers": {"num_instances": 1, "urls": [ctx_url]},
            "generation_servers": {"num_instances": 1, "urls": [gen_url]},
        }
        (tmp / "disagg.yaml").write_text(json.dumps(config))
        router = subprocess.Popen(
            [sys.executable, "-m", "jaxllm", "disaggregated", "-c", str(tmp / "disagg.yaml"), "--log-level", "warning"],
            stdout=open(tmp / "router.log", "w"),
            stderr=subprocess.STDOUT,
        )
        procs.append(router)
        router_url = f"http://127.0.0.1:{router_port}"
        _wait(router, router_url, tmp / "router.log", timeout=120)
        model = args.model
        rows = []
        for mode, url in (("aggregated", agg_url), ("disaggregated", router_url)):
            asyncio.run(
                _run_mode(dict_args(args, num_long=1, decode_streams=1, decode_len=4), mode, url, model)
            )  # warm
            rows.append(asyncio.run(_run_mode(args, mode, url, model)))
        count = _metric_sum(gen_url, "jaxllm:kv_transfer_seconds_count")
        if count:
            rows[1].transfer_ms = _metric_sum(gen_url, "jaxllm:kv_transfer_seconds_sum") / count * 1e3
            rows[1].transfer_kib = _metric_sum(gen_url, "jaxllm:kv_transfer_bytes_total") / count / 1024
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    same = rows[0].texts == rows[1].texts
    print(
        f"model {args.model}: {args.decode_streams} decoding streams ({args.decode_prompt_len}-token prompts, "
        f"{args.decode_len} tokens each) while {args.num_long} prompts of {args.long_len} tokens arrive every "
        f"{args.long_interval}s; workers: max_batch_size {args.max_batch_size}, max_num_tokens {args.max_num_tokens}, "
        f"KV transfer backend {args.backend}"
    )
    print(format_table(rows))
    print(f"same greedy answers in both modes: {same}")
    return 0 if same else 1


def dict_args(args: argparse.Namespace, **changes) -> argparse.Namespace:
    """A copy of `args` with some fields changed (the short warm-up run)."""
    return argparse.Namespace(**{**vars(args), **changes})


if __name__ == "__main__":
    raise SystemExit(main())
