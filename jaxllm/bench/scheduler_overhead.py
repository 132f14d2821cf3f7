"""Host time of one scheduling step, without a model (`jaxllm bench scheduler`).

A step here is the engine's planner (`jaxllm.engine.planner`), everything the host does
before the device can run: capacity scheduling, micro-batching, KV block allocation,
building the StepBatch int32 arrays (token ids, positions, slot mapping, block tables,
...) and the sampling tensors, and moving the requests forward. Sampled tokens are filled
in between steps by a model-free stand-in that is not timed.

Scenarios, each with `running` requests kept in flight:

* decode: every request is generating (one token each per step);
* mixed: requests finish and are replaced by new ones, so steps also carry prompt chunks.

Defaults: max_batch_size = running, max_num_tokens 8192, tokens_per_block 32,
max_seq_len 2048, chunked prefill (first come first served), prefix reuse on, random
prompts of 64-1024 tokens, a KV pool that fits every running request to completion.
The garbage collector is paused while timing so its pauses do not land in one step.

`--kv retention` gives every request a random `KvCacheRetentionConfig` (a prompt range and
the decode blocks at random priorities, half of them with a duration), so cached blocks spread
over the priority buckets; `retention+events` also records KV cache events (drained between
steps, untimed): the rows next to `plain` show what retention and events cost a step.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from dataclasses import dataclass

from jaxllm.engine.planner import Planner
from jaxllm.kv_cache import KvCacheEventBuffer, KVCacheManager, KvEventRecorder
from jaxllm.kv_cache.retention import KvCacheRetentionConfig, TokenRangeRetentionConfig
from jaxllm.llm_args import CapacitySchedulerPolicy, ContextChunkingPolicy, SchedulerConfig
from jaxllm.llm_request import LlmRequest
from jaxllm.sampling import SamplingParams
from jaxllm.scheduler import make_scheduler


@dataclass
class StepTiming:
    scenario: str
    policy: str
    running: int
    kv: str
    mean_ms: float
    p50_ms: float
    p90_ms: float
    max_ms: float
    cpu_p50_ms: float  # thread CPU time: what the step costs without other processes' noise
    tokens_per_step: float
    context_requests_per_step: float


class _Workload:
    """Keeps `running` requests in flight and advances them between timed steps."""

    def __init__(
        self,
        *,
        running: int,
        max_num_tokens: int,
        tokens_per_block: int,
        max_seq_len: int,
        policy: str,
        scenario: str,
        seed: int,
        reuse: bool,
        kv: str = "plain",
    ) -> None:
        self.rng = random.Random(seed)
        self.running = running
        self.max_seq_len = max_seq_len
        self.max_num_tokens = max_num_tokens
        self.scenario = scenario
        max_blocks_per_seq = -(-max_seq_len // tokens_per_block)
        self.retention = kv != "plain"
        self.events = KvCacheEventBuffer(100_000, max_seq_len) if kv == "retention+events" else None
        self.kv = KVCacheManager(
            running * max_blocks_per_seq + 64,
            tokens_per_block,
            max_blocks_per_seq,
            enable_block_reuse=reuse,
            max_num_sequences=running,
            events=None if self.events is None else KvEventRecorder(self.events),
        )
        config = SchedulerConfig(policy, ContextChunkingPolicy.FIRST_COME_FIRST_SERVED)
        self.scheduler = make_scheduler(config, self.kv, running, max_num_tokens, True)
        self.planner = Planner(
            scheduler=self.scheduler,
            kv_cache_manager=self.kv,
            max_batch_size=running,
            max_num_tokens=max_num_tokens,
            min_token_bucket=16,
            max_blocks_per_seq=max_blocks_per_seq,
            max_seq_len=max_seq_len,
        )
        self.active: list[LlmRequest] = []
        self.next_id = 0

    def new_request(self) -> LlmRequest:
        rng = self.rng
        longest = max(1, min(1024, self.max_seq_len // 2))
        prompt_len = rng.randint(min(64, longest), longest)
        room = self.max_seq_len - prompt_len
        if self.scenario == "decode":
            max_new = room  # nobody finishes while we measure
        else:
            max_new = rng.randint(min(16, room), min(256, room))
        self.next_id += 1
        prompt = [rng.randrange(32000) for _ in range(prompt_len)]
        request = LlmRequest(
            self.next_id,
            prompt,
            max_new,
            arrival_time=float(self.next_id),
            sampling_params=SamplingParams(max_tokens=max_new, ignore_eos=True),
        )
        if self.retention:
            duration = 1000 if rng.random() < 0.5 else None
            request.kv_cache_retention_config = KvCacheRetentionConfig(
                [TokenRangeRetentionConfig(0, rng.randint(1, prompt_len), rng.randint(0, 100), duration)],
                decode_retention_priority=rng.randint(0, 100),
                decode_duration_ms=duration,
            )
        return request

    def fill(self) -> None:
        while len(self.active) < self.running:
            self.active.append(self.new_request())

    def timed_step(self):
        t0, c0 = time.perf_counter(), time.thread_time()
        step = self.planner.plan(self.active)
        elapsed, cpu = time.perf_counter() - t0, time.thread_time() - c0
        return elapsed, cpu, step

    def advance(self, step) -> None:
        """The untimed "device": a token for each request the step samples for; retire finished ones."""
        for req, _, index in step.entries:
            req.output_token_ids[index] = self.next_id & 0x7FFF
            if req.reached_max_new_tokens:
                req.finish("length")
                self.kv.free_resources(req)
        self.active = [r for r in self.active if not r.is_finished]
        if self.events is not None:
            self.events.get()
        if self.scenario == "mixed":
            self.fill()

    def warm_up(self) -> None:
        """Run until every request has finished its prompt (decode) or the arrivals have
        reached a steady mix (mixed)."""
        self.fill()
        for _ in range(10_000):
            _, _, step = self.timed_step()
            self.advance(step)
            if self.scenario == "decode" and all(r.is_generation_phase for r in self.active):
                return
            if self.scenario == "mixed" and self.next_id > 2 * self.running:
                return
        raise RuntimeError("warm-up did not converge")


def measure(
    *,
    running: int,
    scenario: str,
    policy: str,
    steps: int,
    max_num_tokens: int = 8192,
    tokens_per_block: int = 32,
    max_seq_len: int = 2048,
    seed: int = 0,
    reuse: bool = True,
    kv: str = "plain",
) -> StepTiming:
    work = _Workload(
        running=running,
        max_num_tokens=max_num_tokens,
        tokens_per_block=tokens_per_block,
        max_seq_len=max_seq_len,
        policy=policy,
        scenario=scenario,
        seed=seed,
        reuse=reuse,
        kv=kv,
    )
    work.warm_up()
    times, cpu_times, tokens, ctx = [], [], [], []
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection in the middle of a step says nothing about the scheduler
    try:
        for _ in range(steps):
            elapsed, cpu, step = work.timed_step()
            out = step.output
            times.append(elapsed * 1e3)
            cpu_times.append(cpu * 1e3)
            tokens.append(out.num_tokens)
            ctx.append(len(out.context_requests))
            work.advance(step)
    finally:
        if gc_was_enabled:
            gc.enable()
    times.sort()
    return StepTiming(
        scenario,
        policy,
        running,
        kv,
        statistics.fmean(times),
        times[len(times) // 2],
        times[int(len(times) * 0.9)],
        times[-1],
        statistics.median(cpu_times),
        statistics.fmean(tokens),
        statistics.fmean(ctx),
    )


def format_table(rows: list[StepTiming]) -> str:
    header = (
        f"{'scenario':<8} {'policy':<20} {'running':>7} {'kv':<16} {'mean ms':>8} {'p50 ms':>8} "
        f"{'p90 ms':>8} {'max ms':>8} {'cpu p50 ms':>10} {'tokens/step':>11} {'ctx reqs/step':>13}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.scenario:<8} {r.policy:<20} {r.running:>7} {r.kv:<16} {r.mean_ms:>8.3f} {r.p50_ms:>8.3f} "
            f"{r.p90_ms:>8.3f} {r.max_ms:>8.3f} {r.cpu_p50_ms:>10.3f} {r.tokens_per_step:>11.1f} "
            f"{r.context_requests_per_step:>13.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from jaxllm.cli.args import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="jaxllm bench scheduler",
        formatter_class=HelpFormatter,
        description="Host time of one scheduling step (capacity + micro-batch + KV block "
        "allocation + StepBatch arrays), no model.",
    )
    parser.add_argument(
        "--running", type=int, nargs="+", default=[256, 1024], help="requests in flight (also max_batch_size)"
    )
    parser.add_argument("--scenario", choices=["decode", "mixed"], nargs="+", default=["decode", "mixed"])
    parser.add_argument(
        "--policy",
        nargs="+",
        default=["GUARANTEED_NO_EVICT", "MAX_UTILIZATION"],
        choices=[p.value for p in CapacitySchedulerPolicy],
    )
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per row")
    parser.add_argument("--no-block-reuse", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--kv",
        nargs="+",
        default=["plain"],
        choices=["plain", "retention", "retention+events"],
        help="KV cache retention configs on every request, and KV cache events on",
    )
    args = parser.parse_args(argv)
    if args.max_seq_len < 2:
        parser.error("--max-seq-len must be at least 2")
    rows = []
    for scenario in args.scenario:
        for running in args.running:
            for policy in args.policy:
                for kv in args.kv:
                    rows.append(
                        measure(
                            running=running,
                            scenario=scenario,
                            policy=policy,
                            steps=args.steps,
                            max_num_tokens=args.max_num_tokens,
                            tokens_per_block=args.tokens_per_block,
                            max_seq_len=args.max_seq_len,
                            seed=args.seed,
                            reuse=not args.no_block_reuse,
                            kv=kv,
                        )
                    )
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
