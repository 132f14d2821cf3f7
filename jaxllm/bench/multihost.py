"""What distributing the step plan costs a multi-host run, next to the step itself.

Starts local processes joined by jax.distributed (gloo collectives on CPU), the same
`tensor_parallel_size` in every row so the model step is the same: one process holding all
devices (the peer: nothing to distribute), then 2 and 4 processes sharing them, with each plan
channel (the coordination service's key-value store, and `broadcast_one_to_all`). The leader
keeps `--running` requests decoding and times `--steps` engine steps; per step it reports the
plan's bytes, the leader's time to encode and send it, and the step time.

    jaxllm bench multihost --processes 1,2,4 --devices 4 --running 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxllm bench multihost", description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", default="1,2,4", help="process counts, comma-separated (1: the peer row)")
    p.add_argument("--devices", type=int, default=4, help="devices in all (tensor_parallel_size), split evenly")
    p.add_argument("--channels", default="kv,collective", help="plan channels, comma-separated")
    p.add_argument("--model", default="tiny-moe")
    p.add_argument("--running", type=int, default=256, help="requests decoding during the timed steps")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--json", action="store_true", help="one JSON object per row instead of a table")
    # Internal: a process of one row's run.
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)
    return p


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _measure(args: argparse.Namespace, channel: str) -> dict:
    """Leader (or single process): fill the engine with decoding requests, then time steps."""
    import jax
    import numpy as np

    from jaxllm import KvCacheConfig, SamplingParams
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine

    n = args.running
    # Tokens per step: room for every decode token plus prompt chunks, so all `n` requests get in.
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype="float32",
            max_batch_size=n,
            max_num_tokens=2 * n,
            max_seq_len=args.max_seq_len,
            kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=n * args.max_seq_len),
            tensor_parallel_size=args.devices,
            multihost_plan_channel=channel,
            compile_cache=False,
        )
    )
    engine.warmup(all_variants=False)
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.max_seq_len - args.prompt_len, ignore_eos=True)
    for _ in range(n):
        engine.add_request(rng.integers(3, engine.model_config.vocab_size, args.prompt_len).tolist(), params)
    while any(r.is_context_phase for r in engine.active.values()) or engine.num_queued:
        engine.step()
    for _ in range(3):  # steady decode before timing
        engine.step()
    stats = getattr(engine.step_runner, "channel_stats", None)
    step_ms, send_ms, encode_ms, sizes = [], [], [], []
    for _ in range(args.steps):
        before = (stats.messages, stats.bytes, stats.send_seconds, stats.encode_seconds) if stats else None
        started = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - started) * 1e3)
        if stats is not None:
            sizes.append(stats.bytes - before[1])
            send_ms.append((stats.send_seconds - before[2]) * 1e3)
            encode_ms.append((stats.encode_seconds - before[3]) * 1e3)
    running = sum(1 for r in engine.active.values() if not r.is_context_phase)
    engine.close()
    return dict(
        processes=jax.process_count(),
        devices=jax.device_count(),
        channel=channel if stats else "-",
        running=running,
        step_ms=statistics.median(step_ms),
        bytes_per_step=statistics.median(sizes) if sizes else 0,
        encode_ms=statistics.median(encode_ms) if encode_ms else 0.0,
        send_ms=statistics.median(send_ms) if send_ms else 0.0,
    )


def _run_row(args: argparse.Namespace) -> int:
    """One process of a row: join the run, then lead (process 0) or follow."""
    row = json.loads(args.row)
    from sharding import multihost

    if row["processes"] > 1:
        multihost.initialize(multihost.DistributedConfig(f"127.0.0.1:{row['port']}", row["processes"], row["pid"]))
        if not multihost.is_leader():
            from jaxllm.engine.followers import run_follower

            return run_follower()
    print(json.dumps(_measure(args, row["channel"])), flush=True)
    return 0


def _launch(args: argparse.Namespace, argv: list[str], processes: int, channel: str) -> Optional[dict]:
    per_process = args.devices // processes
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={per_process}")
    procs, logs = [], [tempfile.TemporaryFile() for _ in range(processes)]
    try:
        for pid in range(processes):
            row = json.dumps(dict(processes=processes, pid=pid, port=port, channel=channel))
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "jaxllm.bench.multihost", *argv, "--row", row],
                    env=env,
                    stdout=subprocess.PIPE if pid == 0 else subprocess.DEVNULL,
                    stderr=logs[pid],
                    text=True,
                    start_new_session=True,
                )
            )
        out, _ = procs[0].communicate(timeout=1800)
        for proc in procs[1:]:
            proc.wait(120)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if procs[0].returncode != 0 or not lines:
        print(
            f"row processes={processes} channel={channel} failed (exit codes {[p.returncode for p in procs]})",
            file=sys.stderr,
        )
        for pid, log in enumerate(logs):
            log.seek(0)
            tail = [line for line in log.read().decode(errors="replace").splitlines() if "[Gloo]" not in line]
            print(f"--- process {pid}:\n" + "\n".join(tail[-8:]), file=sys.stderr)
        return None
    return json.loads(lines[-1])


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.row is not None:
        return _run_row(args)
    rows = []
    for processes in (int(p) for p in args.processes.split(",")):
        if args.devices % processes:
            raise SystemExit(f"--devices {args.devices} does not split over {processes} processes")
        for channel in ["kv"] if processes == 1 else args.channels.split(","):
            row = _launch(args, argv, processes, channel)
            if row is None:
                continue
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
    if not args.json:
        print(
            f"model {args.model}, tensor_parallel_size {args.devices}, {args.running} requests decoding, "
            f"median of {args.steps} steps"
        )
        print(
            f"{'processes':>9} {'channel':>10} {'running':>7} {'step ms':>8} {'plan bytes':>10} {'encode ms':>9} "
            f"{'send ms':>8} {'share':>6}"
        )
        for r in rows:
            share = (r["encode_ms"] + r["send_ms"]) / r["step_ms"] if r["step_ms"] else 0.0
            print(
                f"{r['processes']:>9} {r['channel']:>10} {r['running']:>7} {r['step_ms']:>8.2f} "
                f"{int(r['bytes_per_step']):>10} {r['encode_ms']:>9.3f} {r['send_ms']:>8.3f} {share:>6.1%}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
