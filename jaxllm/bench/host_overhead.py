"""Host time and device idle time per engine step, with a real model (`jaxllm bench host`).

Keeps `running` requests decoding (short prompts, long outputs, greedy, EOS ignored, so
nobody finishes while timed) in an `LLMEngine` and times `engine.step()`:

* host ms: the step's wall time minus the time it blocked reading a step's tokens back
  (what the host itself spends: scheduling, KV blocks, batch and sampling arrays,
  dispatch, applying tokens); host CPU ms: the engine thread's CPU time in the step
  (less sensitive to other processes sharing the cores); dispatch ms: the part spent
  handing the step to the runtime (input transfer and the two program calls);
* device idle ms: time between one step's device work finishing and the next step's
  forward being enqueued. A watcher thread blocks on each step's sampled tokens and
  notes when they are ready (its wake-up can lag by a GIL hand-off, so idle time is, if
  anything, under-reported by that much).

The overlap scheduler (default) enqueues step N+1 before reading step N back, so host
work hides behind the device as long as it is shorter than a device step; the peer run
`--overlap off` reads every step back before planning the next, so its idle time is the
host time. On a CPU backend the "device" is the same cores as the host, so device steps
are slow and host time competes with them; the figures that carry over to a GPU are the
host ms and host CPU ms columns.

    jaxllm bench host --model tiny-moe --running 64 256
"""

from __future__ import annotations

import argparse
import gc
import queue
import statistics
import threading
import time
from dataclasses import dataclass


@dataclass
class HostStepTiming:
    running: int
    overlap: bool
    steps: int
    step_ms: float  # p50 wall time of engine.step()
    host_ms: float  # p50 of step wall time minus device wait
    host_mean_ms: float
    host_cpu_ms: float  # p50 engine-thread CPU time per step
    dispatch_ms: float  # p50 time handing the step to the runtime
    idle_ms: float  # p50 device idle time before each step's forward
    idle_mean_ms: float
    idle_share: float  # device idle time / total time


class DeviceWatcher:
    """Notes when each dispatched step's device work is done, off the engine thread."""

    def __init__(self) -> None:
        self.enqueued: list[float] = []
        self.finished: list[float] = []
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="jaxllm-bench-watcher", daemon=True)
        self._thread.start()

    def __call__(self, enqueue_time: float, sampler_output) -> None:
        self.enqueued.append(enqueue_time)
        self._queue.put(sampler_output.token_ids)

    def _run(self) -> None:
        while True:
            tokens = self._queue.get()
            if tokens is None:
                return
            tokens.block_until_ready()
            self.finished.append(time.perf_counter())

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def idle_gaps(self) -> list[float]:
        """Seconds the device waited before each step after the first (0 when it was queued in time)."""
        return [
            max(0.0, self.enqueued[i] - self.finished[i - 1])
            for i in range(1, min(len(self.enqueued), len(self.finished) + 1))
        ]


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def measure(
    *,
    model: str,
    running: int,
    steps: int,
    overlap: bool,
    prompt_len: tuple[int, int],
    dtype: str = "auto",
    seed: int = 0,
    warm_steps: int = 10,
) -> HostStepTiming:
    import numpy as np

    from jaxllm import KvCacheConfig, SamplingParams
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine

    tpb = 32
    max_new = steps + warm_steps + 64
    max_seq_len = -(-(prompt_len[1] + max_new) // tpb) * tpb
    config = EngineConfig(
        model=model,
        dtype=dtype,
        max_batch_size=running,
        max_num_tokens=max(256, 2 * running),
        max_seq_len=max_seq_len,
        disable_overlap_scheduler=not overlap,
        kv_cache_config=KvCacheConfig(tokens_per_block=tpb, max_tokens=running * max_seq_len),
    )
    engine = LLMEngine(config)
    engine.warmup(all_variants=False)
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    for _ in range(running):
        prompt = rng.integers(3, vocab, size=int(rng.integers(prompt_len[0], prompt_len[1] + 1))).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=max_new, ignore_eos=True, temperature=0.0))
    while any(r.is_context_phase for r in engine.active.values()):
        engine.step()
    for _ in range(warm_steps):
        engine.step()
    watcher = DeviceWatcher()
    engine.on_dispatch = watcher
    wall, host, cpu, dispatch = [], [], [], []
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection inside one step says nothing about the host path
    start = time.perf_counter()
    try:
        for _ in range(steps):
            before = engine.timing.device_wait_seconds, engine.timing.dispatch_seconds
            t0, c0 = time.perf_counter(), time.thread_time()
            engine.step()
            elapsed, cpu_s = time.perf_counter() - t0, time.thread_time() - c0
            wait = engine.timing.device_wait_seconds - before[0]
            wall.append(elapsed * 1e3)
            host.append((elapsed - wait) * 1e3)
            cpu.append(cpu_s * 1e3)
            dispatch.append((engine.timing.dispatch_seconds - before[1]) * 1e3)
    finally:
        if gc_was_enabled:
            gc.enable()
        engine.on_dispatch = None
    total = time.perf_counter() - start
    watcher.close()  # returns once every watched step is done
    gaps = watcher.idle_gaps()
    if any(r.is_finished for r in engine.active.values()) or len(engine.active) != running:
        raise RuntimeError("a request finished while timed; the measurement is not of a steady decode batch")
    for request_id in list(engine.active):
        engine.abort_request(request_id)
    return HostStepTiming(
        running,
        overlap,
        steps,
        _p50(wall),
        _p50(host),
        statistics.fmean(host),
        _p50(cpu),
        _p50(dispatch),
        _p50(gaps) * 1e3,
        statistics.fmean(gaps) * 1e3 if gaps else float("nan"),
        sum(gaps) / total,
    )


def format_table(rows: list[HostStepTiming]) -> str:
    header = (
        f"{'running':>7} {'overlap':>7} {'steps':>5} {'step ms':>8} {'host ms':>8} {'host mean':>9} "
        f"{'host cpu ms':>11} {'dispatch ms':>11} {'idle ms p50':>11} {'idle mean':>9} {'idle share':>10}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.running:>7} {'on' if r.overlap else 'off':>7} {r.steps:>5} {r.step_ms:>8.2f} "
            f"{r.host_ms:>8.3f} {r.host_mean_ms:>9.3f} {r.host_cpu_ms:>11.3f} {r.dispatch_ms:>11.3f} "
            f"{r.idle_ms:>11.3f} {r.idle_mean_ms:>9.3f} {r.idle_share:>10.1%}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from jaxllm.cli.args import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="jaxllm bench host",
        formatter_class=HelpFormatter,
        description="Host time and device idle time per engine step with `running` requests decoding, "
        "with the overlap scheduler and, side by side, without it.",
    )
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--running", type=int, nargs="+", default=[64, 256], help="requests decoding (also max_batch_size)"
    )
    parser.add_argument("--overlap", choices=["on", "off"], nargs="+", default=["on", "off"])
    parser.add_argument("--steps", type=int, default=60, help="timed steps per row")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[8, 32], metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be at least 2")
    if min(args.running) < 1:
        parser.error("--running must be positive")
    rows = []
    for running in args.running:
        for overlap in args.overlap:
            rows.append(
                measure(
                    model=args.model,
                    running=running,
                    steps=args.steps,
                    overlap=overlap == "on",
                    prompt_len=tuple(args.prompt_len),
                    dtype=args.dtype,
                    seed=args.seed,
                )
            )
            print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
