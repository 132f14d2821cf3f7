"""What the host KV tier saves on multi-turn chat (`jaxllm bench kv-tier`).

`--conversations` conversations of `--turns` turns; each turn's prompt is the conversation so
far (every earlier prompt and answer) plus a new `--user-len`-token message, and the answer has
`--output-len` tokens (greedy, EOS ignored). The conversations are interleaved: turn t of
every conversation runs (`--concurrency` at a time) before turn t + 1 of any, so a device pool
of `--device-tokens` cannot keep every history until its next turn. Three engines run the same
workload side by side:
  * `off`: that device pool, no host tier (evicted histories are recomputed);
  * `host`: the same device pool with a `--host-size` host tier;
  * `unbounded`: a device pool holding every conversation (the floor of prefill work).
Columns: prompt tokens computed (prefill) and its ratio to `unbounded`, blocks reused from
either tier, TTFT p50 / p99 (from submission to the step whose read-back holds the first token),
output tokens per second over the run, bytes copied to and from the host and the time the copies
took. Every engine has the same shapes (rows for every conversation) and is warmed up first
(model programs and the copy programs).

    jaxllm bench kv-tier --model tiny-moe
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np


@dataclass
class TierRow:
    mode: str
    prefill_tokens: int
    reused_blocks: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    seconds: float
    output_tokens: int
    bytes_moved: int
    copy_ms: float
    tokens: list

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


def run_chat(engine, args, mode: str) -> TierRow:
    from jaxllm.sampling import SamplingParams

    rng = np.random.default_rng(args.seed)
    vocab = engine.model_config.vocab_size
    histories = [[int(t) for t in rng.integers(3, vocab, args.system_len)] for _ in range(args.conversations)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    ttfts: list[float] = []
    answers: list = []
    stats_before = len(engine.iteration_stats)
    started = time.perf_counter()
    output_tokens = 0
    for _turn in range(args.turns):
        for start in range(0, args.conversations, args.concurrency):
            batch = []
            for i in range(start, min(start + args.concurrency, args.conversations)):
                histories[i] = histories[i] + [int(t) for t in rng.integers(3, vocab, args.user_len)]
                batch.append((i, engine.add_request(histories[i], params), time.perf_counter()))
            first: dict[int, float] = {}
            while engine.has_unfinished_requests():
                engine.step()
                now = time.perf_counter()
                for i, request, submitted in batch:
                    if i not in first and request.output_token_ids:
                        first[i] = now - submitted
            for i, request, _ in batch:
                histories[i] = histories[i] + list(request.output_token_ids)
                answers.append(list(request.output_token_ids))
                output_tokens += len(request.output_token_ids)
                ttfts.append(first.get(i, 0.0))
    seconds = time.perf_counter() - started
    steps = engine.iteration_stats[stats_before:]
    kv_stats = engine.iteration_stats[-1]["kvCacheStats"]
    offload = engine.kv_offload
    moved = 0 if offload is None else offload.counts.offloaded_bytes + offload.counts.onboarded_bytes
    return TierRow(
        mode=mode,
        prefill_tokens=sum(s["inflightBatchingStats"]["numCtxTokens"] for s in steps),
        reused_blocks=kv_stats["reusedBlocks"],
        ttft_p50_ms=1e3 * float(np.percentile(ttfts, 50)),
        ttft_p99_ms=1e3 * float(np.percentile(ttfts, 99)),
        seconds=seconds,
        output_tokens=output_tokens,
        bytes_moved=moved,
        copy_ms=0.0 if offload is None else offload.counts.copy_seconds * 1e3,
        tokens=answers,
    )


def format_table(rows: list[TierRow]) -> str:
    floor = rows[-1].prefill_tokens or 1
    head = (
        f"{'mode':<10} {'prefill tok':>11} {'vs unbounded':>12} {'reused blk':>10} {'TTFT p50 ms':>11} "
        f"{'TTFT p99 ms':>11} {'out tok/s':>9} {'vs off':>6} {'MiB moved':>9} {'copy ms':>8}"
    )
    lines = [head, "-" * len(head)]
    base = rows[0].tokens_per_s or 1.0
    for r in rows:
        lines.append(
            f"{r.mode:<10} {r.prefill_tokens:>11} {r.prefill_tokens / floor:>11.2f}x {r.reused_blocks:>10} "
            f"{r.ttft_p50_ms:>11.1f} {r.ttft_p99_ms:>11.1f} {r.tokens_per_s:>9.1f} {r.tokens_per_s / base:>5.2f}x "
            f"{r.bytes_moved / 2**20:>9.2f} {r.copy_ms:>8.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from jaxllm.cli.args import HelpFormatter
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine
    from jaxllm.llm_args import KvCacheConfig

    parser = argparse.ArgumentParser(
        prog="jaxllm bench kv-tier",
        formatter_class=HelpFormatter,
        description="Multi-turn chat with a device KV pool too small for every conversation: the host KV "
        "tier off, on, and an unbounded device pool side by side (prefill tokens, TTFT, tokens/s, bytes moved).",
    )
    parser.add_argument("--model", default="tiny-moe")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4, help="conversations whose turn runs at once")
    parser.add_argument("--system-len", type=int, default=64, help="tokens of each conversation's first message")
    parser.add_argument("--user-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--tokens-per-block", type=int, default=16)
    parser.add_argument("--device-tokens", type=int, default=1024, help="the device KV pool of `off` and `host`")
    parser.add_argument("--host-size", default="64MiB", help="host tier size (units such as 8GiB)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-warmup", action="store_true", help="skip compiling before the runs (TTFT then counts the compiles)"
    )
    args = parser.parse_args(argv)
    for name in ("conversations", "turns", "concurrency", "system_len", "user_len", "output_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")

    tpb = args.tokens_per_block
    longest = args.system_len + args.turns * (args.user_len + args.output_len)
    max_seq_len = -(-(longest + tpb) // tpb) * tpb
    unbounded = args.conversations * max_seq_len + args.concurrency * max_seq_len
    rows = []
    for mode, device_tokens, host in (
        ("off", args.device_tokens, None),
        ("host", args.device_tokens, args.host_size),
        ("unbounded", unbounded, None),
    ):
        engine = LLMEngine(
            EngineConfig(
                model=args.model,
                dtype=args.dtype,
                # On a host the pool is capped at max_batch_size * max_seq_len tokens: room for the
                # unbounded pool in every mode (at most `concurrency` requests run at once anyway).
                max_batch_size=args.conversations + args.concurrency,
                max_num_tokens=max(256, tpb),
                max_seq_len=max_seq_len,
                kv_cache_config=KvCacheConfig(tokens_per_block=tpb, max_tokens=device_tokens, host_cache_size=host),
            )
        )
        if not args.no_warmup:
            engine.warmup()  # the host tier's copy programs too
        rows.append(run_chat(engine, args, mode))
        engine.close()
    same = all(r.tokens == rows[0].tokens for r in rows)
    print(
        f"model {args.model}: {args.conversations} conversations x {args.turns} turns ({args.concurrency} at "
        f"a time), first message {args.system_len} tokens, user {args.user_len}, answers {args.output_len}; "
        f"device pool {args.device_tokens} tokens (unbounded: {unbounded}), host tier {args.host_size}"
    )
    print(format_table(rows))
    print(f"same greedy tokens in every mode: {same}")
    host_row, floor = rows[1], rows[-1].prefill_tokens or 1
    print(
        f"goal, host tier prefill tokens within 10% of the unbounded pool's: {host_row.prefill_tokens / floor:.3f}x "
        f"({'met' if host_row.prefill_tokens <= 1.1 * floor else 'not met'})"
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
