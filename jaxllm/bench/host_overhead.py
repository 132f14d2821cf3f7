"""Host time, device time and device idle time per engine step, with a real model (`jaxllm bench host`).

Keeps `running` requests decoding (short prompts, long outputs, greedy, EOS ignored, so
nobody finishes while timed) in an `LLMEngine` and reads each `engine.step()`'s share of
`EngineTiming` (`jaxllm.engine.step_output`), per step, p50 and mean:

* host cpu ms: the engine thread's CPU time in the step (`time.thread_time()`): what the
  host itself spends (scheduling, KV blocks, batch and sampling arrays, dispatch, applying
  tokens), least sensitive to other processes sharing the cores;
* host wall ms: the step's wall time with every device wait excluded: the blocking reads
  (the previous step's tokens, and any other read of a device value) and the time blocked
  inside the program calls (their wall minus CPU time). A device wait cannot hide in it:
  where the runtime blocks while dispatching (a `while` loop whose trip count lives on the
  device, read back by XLA on a GPU every trip) it shows as dispatch wait, not host time;
* host ms: the step's wall time minus its blocking reads only (dispatch waits included,
  the figure this benchmark reported before); dispatch ms: the part spent handing the step
  to the runtime (input transfer and the program calls);
* reads/step: blocking device reads the engine thread made in the step (a steady decode
  step makes one: the previous step's tokens; `--overlap off` makes one, its own tokens);
* device ms / device idle ms, from host-side timestamps: a watcher thread blocks on each
  step's sampled tokens and notes when they are ready (`DeviceWatcher`). Device busy time
  of step i is finish[i] - max(enqueue[i], finish[i-1]) (its work cannot start before it
  was enqueued nor before the step ahead of it ended); idle time is
  max(0, enqueue[i] - finish[i-1]). The watcher's wake-up can lag by a GIL hand-off, which
  moves that much from idle to busy time.

The overlap scheduler (default) enqueues step N+1 before reading step N back, so host
work hides behind the device as long as it is shorter than a device step; the peer run
`--overlap off` reads every step back before planning the next, so its idle time is the
host time. On a CPU backend the "device" is the same cores as the host, so device steps
are slow and host time competes with them; the figures that carry over to a GPU are the
host cpu ms, host wall ms and reads/step columns.

`--vocab-size` runs a random-weight dense model of that vocabulary instead of `--model`
(tiny-dense's architecture and tokenizer, `--num-layers` layers of `--hidden-size`): host
work that grows with the vocabulary shows at a negligible device cost.

    jaxllm bench host --model tiny-moe --running 64 256
    jaxllm bench host --vocab-size 128256 --running 256
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import queue
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass
class HostStepTiming:
    running: int
    overlap: bool
    steps: int
    step_ms: float  # p50 wall time of engine.step()
    host_ms: float  # p50 of step wall time minus blocking reads (dispatch waits included)
    host_mean_ms: float
    host_cpu_ms: float  # p50 engine-thread CPU time per step
    dispatch_ms: float  # p50 time handing the step to the runtime
    idle_ms: float  # p50 device idle time before each step's forward
    idle_mean_ms: float
    idle_share: float  # device idle time / total time
    host_cpu_mean_ms: float
    host_wall_ms: float  # p50 step wall time with every device wait excluded
    host_wall_mean_ms: float
    device_ms: float  # p50 device busy time per step (host-side timestamps)
    device_mean_ms: float
    reads_per_step: float  # mean blocking device reads per step
    max_reads_per_step: int


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

    def busy_times(self) -> list[float]:
        """Seconds of device work of each step after the first: from when it could start (it
        was enqueued and the step ahead of it was done) to when its tokens were ready."""
        return [
            max(0.0, self.finished[i] - max(self.enqueued[i], self.finished[i - 1]))
            for i in range(1, min(len(self.enqueued), len(self.finished)))
        ]


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


@contextlib.contextmanager
def random_model(vocab_size: int, num_layers: int = 1, hidden_size: int = 64, seed: int = 0) -> Iterator[str]:
    """A temporary random-weight model directory: tiny-dense's architecture and tokenizer with
    `vocab_size` tokens (ids past the tokenizer's are plain rows), `num_layers` layers of
    `hidden_size` (MLP twice as wide)."""
    import json
    import shutil

    from safetensors.numpy import save_file

    from jaxllm.models.model_config import ModelConfig
    from jaxllm.models.presets import PRESETS, materialize_preset
    from jaxllm.models.random_checkpoint import random_checkpoint

    if vocab_size < 1024 or num_layers < 1 or hidden_size < 8:
        raise ValueError(
            f"random model: vocab_size must be >= 1024, num_layers >= 1 and hidden_size >= 8; "
            f"got {vocab_size}, {num_layers}, {hidden_size}"
        )
    preset = PRESETS["tiny-dense"]
    hf = {
        **preset.hf_config,
        "architectures": [preset.architecture],
        "model_type": preset.model_type,
        "vocab_size": vocab_size,
        "num_hidden_layers": num_layers,
        "max_window_layers": num_layers,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    tokenizer = materialize_preset("tiny-dense")
    with tempfile.TemporaryDirectory(prefix="jaxllm-bench-host-") as tmp:
        directory = Path(tmp)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer / name, directory / name)
        (directory / "config.json").write_text(json.dumps(hf, indent=1, sort_keys=True))
        weights = random_checkpoint(ModelConfig.from_hf_config(hf), seed)
        save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
        yield tmp


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
    wall, host, host_wall, cpu, dispatch, reads = [], [], [], [], [], []
    fields = ("step_seconds", "host_seconds", "host_wall_seconds", "host_cpu_seconds", "dispatch_seconds")
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection inside one step says nothing about the host path
    start = time.perf_counter()
    try:
        for _ in range(steps):
            t = engine.timing
            before = [getattr(t, f) for f in fields] + [t.blocking_reads]
            engine.step()
            t = engine.timing
            delta = [getattr(t, f) - b for f, b in zip(fields, before)]
            for column, value in zip((wall, host, host_wall, cpu, dispatch), delta):
                column.append(value * 1e3)
            reads.append(t.blocking_reads - before[-1])
    finally:
        if gc_was_enabled:
            gc.enable()
        engine.on_dispatch = None
    total = time.perf_counter() - start
    watcher.close()  # returns once every watched step is done
    gaps, busy = watcher.idle_gaps(), watcher.busy_times()
    if any(r.is_finished for r in engine.active.values()) or len(engine.active) != running:
        raise RuntimeError("a request finished while timed; the measurement is not of a steady decode batch")
    for request_id in list(engine.active):
        engine.abort_request(request_id)
    engine.close()
    return HostStepTiming(
        running,
        overlap,
        steps,
        _p50(wall),
        _p50(host),
        _mean(host),
        _p50(cpu),
        _p50(dispatch),
        _p50(gaps) * 1e3,
        _mean(gaps) * 1e3,
        sum(gaps) / total,
        host_cpu_mean_ms=_mean(cpu),
        host_wall_ms=_p50(host_wall),
        host_wall_mean_ms=_mean(host_wall),
        device_ms=_p50(busy) * 1e3,
        device_mean_ms=_mean(busy) * 1e3,
        reads_per_step=_mean(reads),
        max_reads_per_step=max(reads, default=0),
    )


_COLUMNS = (  # header, width, format of the value
    ("running", 7, "d"),
    ("overlap", 7, "s"),
    ("steps", 5, "d"),
    ("step ms", 8, ".2f"),
    ("host cpu ms", 11, ".3f"),
    ("cpu mean", 8, ".3f"),
    ("host wall ms", 12, ".3f"),
    ("wall mean", 9, ".3f"),
    ("host ms", 8, ".3f"),
    ("host mean", 9, ".3f"),
    ("dispatch ms", 11, ".3f"),
    ("reads/step", 10, ".2f"),
    ("device ms", 9, ".3f"),
    ("device mean", 11, ".3f"),
    ("idle ms p50", 11, ".3f"),
    ("idle mean", 9, ".3f"),
    ("idle share", 10, ".1%"),
)


def _values(r: HostStepTiming) -> tuple:
    return (
        r.running,
        "on" if r.overlap else "off",
        r.steps,
        r.step_ms,
        r.host_cpu_ms,
        r.host_cpu_mean_ms,
        r.host_wall_ms,
        r.host_wall_mean_ms,
        r.host_ms,
        r.host_mean_ms,
        r.dispatch_ms,
        r.reads_per_step,
        r.device_ms,
        r.device_mean_ms,
        r.idle_ms,
        r.idle_mean_ms,
        r.idle_share,
    )


def format_table(rows: list[HostStepTiming]) -> str:
    """One line per row: p50 per step, with the mean beside the host and device columns."""
    header = " ".join(f"{name:>{width}}" for name, width, _ in _COLUMNS)
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(" ".join(f"{v:>{width}{fmt}}" for (_, width, fmt), v in zip(_COLUMNS, _values(r))))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from jaxllm.cli.args import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="jaxllm bench host",
        formatter_class=HelpFormatter,
        description="Host CPU and wall time (device waits excluded), blocking device reads, device time and "
        "device idle time per engine step with `running` requests decoding, with the overlap scheduler and, "
        "side by side, without it.",
    )
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="run a random-weight dense model with this many tokens instead of --model (e.g. 128256)",
    )
    parser.add_argument("--num-layers", type=int, default=None, help="layers of the --vocab-size model (default 1)")
    parser.add_argument("--hidden-size", type=int, default=None, help="width of the --vocab-size model (default 64)")
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
    if args.vocab_size is None and (args.num_layers is not None or args.hidden_size is not None):
        parser.error("--num-layers and --hidden-size shape the --vocab-size model: give --vocab-size")
    with contextlib.ExitStack() as stack:
        model = args.model
        if args.vocab_size is not None:
            try:
                model = stack.enter_context(
                    random_model(args.vocab_size, args.num_layers or 1, args.hidden_size or 64, args.seed)
                )
            except ValueError as exc:
                parser.error(str(exc))
        rows = run_rows(args, model)
    print(format_table(rows))
    return 0


def run_rows(args: argparse.Namespace, model: str) -> list[HostStepTiming]:
    """Every (running, overlap) row, each line printed once measured."""
    rows: list[HostStepTiming] = []
    for running in args.running:
        for overlap in args.overlap:
            rows.append(
                measure(
                    model=model,
                    running=running,
                    steps=args.steps,
                    overlap=overlap == "on",
                    prompt_len=tuple(args.prompt_len),
                    dtype=args.dtype,
                    seed=args.seed,
                )
            )
            print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
