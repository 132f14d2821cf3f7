"""The KV hand-over's transports side by side (`jaxllm bench kv-transfer`): TCP, shared memory
(SHM) and device to device (TRANSFER, `jax.experimental.transfer`) between two processes.

Starts one context worker (`jaxllm serve` with a cache transceiver); this process is the
generation side. Each round sends a context-only request of `--prompt-len` tokens and pulls
its blocks with every backend in turn (the order rotates per round, so load drifts hit all
alike), timing the pull from the claim until the blocks are in this process (on its device
for TRANSFER): the claim, the context worker's block reads and the copy. The first round
warms up and is not counted. Columns: median and p90 ms per hand-over, MiB/s, and the
median's ratio to TCP's. Nothing is written into a KV pool here (the write is the same for
every backend).

    jaxllm bench kv-transfer --model tiny-dense --prompt-len 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxllm.bench.disagg import _free_port, _wait

BACKENDS = ("TCP", "SHM", "TRANSFER")


def main(argv: list[str] | None = None) -> int:
    from jaxllm.cli.args import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="jaxllm bench kv-transfer",
        formatter_class=HelpFormatter,
        description="KV hand-over between two processes over TCP, shared memory and jax.experimental.transfer.",
    )
    parser.add_argument("--model", default="tiny-dense")
    parser.add_argument("--prompt-len", type=int, default=1024, help="tokens of each handed-over prompt")
    parser.add_argument("--rounds", type=int, default=10, help="hand-overs per backend (plus one warm-up)")
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--max-num-tokens", type=int, default=512)
    args = parser.parse_args(argv)
    if args.prompt_len + 1 > args.max_seq_len:
        parser.error("--prompt-len must be below --max-seq-len")

    import subprocess

    import httpx
    import jax

    from jaxllm.engine.kv_transfer import fetch_kv

    tmp = Path(tempfile.mkdtemp(prefix="jaxllm-bench-kv-transfer-"))
    (tmp / "ctx.yaml").write_text("cache_transceiver_config:\n  backend: DEFAULT\n")
    port = _free_port()
    cmd = [sys.executable, "-m", "jaxllm", "serve", "--model", args.model, "--port", str(port)]
    cmd += ["--max-seq-len", str(args.max_seq_len), "--max-num-tokens", str(args.max_num_tokens)]
    cmd += ["--config", str(tmp / "ctx.yaml"), "--log-level", "warning"]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, stdout=open(tmp / "ctx.log", "w"), stderr=subprocess.STDOUT)
    times: dict[str, list[float]] = {b: [] for b in BACKENDS}
    nbytes = 0
    try:
        _wait(proc, url, tmp / "ctx.log")
        prompt = [(7 * i + 3) % 200 + 5 for i in range(args.prompt_len)]
        body = {"model": args.model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
        body["disaggregated_params"] = {"request_type": "context_only"}
        device = jax.devices()[0]
        for rnd in range(args.rounds + 1):
            for i in range(len(BACKENDS)):
                backend = BACKENDS[(rnd + i) % len(BACKENDS)]
                answer = httpx.post(url + "/v1/completions", json=body, timeout=300).json()
                handle = answer["choices"][0]["disaggregated_params"]
                started = time.perf_counter()
                payload = fetch_kv(
                    handle["ctx_info_endpoint"],
                    handle["ctx_request_id"],
                    handle["opaque_state"],
                    transport=backend,
                    device=device,
                )
                if payload.device_chunks is not None:
                    jax.block_until_ready(payload.device_chunks)
                if rnd:
                    times[backend].append((time.perf_counter() - started) * 1e3)
                nbytes = payload.num_bytes
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(
        f"model {args.model}: hand-over of a {args.prompt_len}-token prompt ({nbytes / 2**20:.2f} MiB of KV blocks) "
        f"from a context worker process to this one, {args.rounds} rounds, backends in rotating order"
    )
    base = statistics.median(times["TCP"])
    header = f"{'backend':10s} {'median ms':>10s} {'p90 ms':>10s} {'MiB/s':>10s} {'vs TCP':>8s}"
    print(header)
    print("-" * len(header))
    for backend in BACKENDS:
        med = statistics.median(times[backend])
        p90 = float(np.percentile(times[backend], 90))
        rate = nbytes / 2**20 / (med / 1e3)
        print(f"{backend:10s} {med:10.2f} {p90:10.2f} {rate:10.1f} {med / base:7.2f}x")
    print(json.dumps({b: [round(t, 2) for t in v] for b, v in times.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
