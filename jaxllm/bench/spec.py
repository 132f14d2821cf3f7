"""Speculative decoding's speed-up (`jaxllm bench spec`).

Two engines with the same limits run the same requests side by side: `base` without speculation
(overlap scheduler and steady decode on, as served by default) and `spec` with `--method`
(n-gram drafts: `NGramDecodingConfig`; `mtp`: DeepSeek-V3's MTP layers, `MTPDecodingConfig`, on
a tiny random checkpoint by default: `jaxllm.bench.tiny_mtp`). The workload is one where the
output repeats its input, where prompt lookup drafts are right: rewriting a paragraph,
extracting lines from a record, editing code (each prompt shows a text and asks for it back
with a small change, in the model's chat template). At each concurrency (requests kept in
flight, a new one joining as one finishes) the table shows output tokens per second of both,
their ratio, the mean acceptance length (tokens a verifying row emits per step: accepted drafts
+ 1) and the drafted and accepted tokens; the greedy outputs of both engines are compared token
for token. Each engine runs each concurrency `--repeats` times, alternating with the other, and
its fastest run counts (a shared machine's load changes during a run).

    jaxllm bench spec --method ngram --model smollm2
    jaxllm bench spec --method mtp --max-draft-len 2
    jaxllm bench spec --method draft --model tiny-moe --draft-model tiny-moe
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

TEXTS = [
    "The quick brown fox jumps over the lazy dog. The dog does not move, and the fox runs back into the "
    "forest, where the trees are tall and the light is green. Every morning the fox comes back to the same "
    "field to look for the dog.",
    "def moving_average(values, window):\n    result = []\n    total = 0.0\n    for i, value in "
    "enumerate(values):\n        total += value\n        if i >= window:\n            total -= values[i - "
    "window]\n        if i >= window - 1:\n            result.append(total / window)\n    return result\n",
    "Name: Alice Smith\nEmail: alice.smith@example.com\nPhone: 555-0101\nCity: Springfield\nRole: Engineer\n"
    "Name: Bob Jones\nEmail: bob.jones@example.com\nPhone: 555-0102\nCity: Shelbyville\nRole: Designer\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        "
    "self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n    def is_empty(self):"
    "\n        return not self.items\n",
    "Our meeting is on Monday at ten in the morning. Please bring the report, the budget and the list of "
    "open questions. After the meeting we will have lunch together and then visit the new office building.",
]
TASKS = [
    "Repeat the following text exactly, word for word:\n\n{text}",
    "Rewrite the following text, keeping everything the same:\n\n{text}",
    "Copy this code exactly as it is:\n\n{text}",
    "Extract every line of the following record, unchanged:\n\n{text}",
]


@dataclass
class Run:
    seconds: float
    output_tokens: int
    tokens: list
    drafted: int = 0
    accepted: int = 0
    verified_rows: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance_length(self) -> float:
        return (self.accepted + self.verified_rows) / self.verified_rows if self.verified_rows else 1.0


def prompts(tokenizer, count: int) -> list[list[int]]:
    out = []
    for i in range(count):
        message = TASKS[i % len(TASKS)].format(text=TEXTS[i % len(TEXTS)])
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer.encode(text, add_special_tokens=False)
        except Exception:  # no chat template: the plain text
            ids = tokenizer.encode(message)
        out.append([int(t) for t in ids])
    return out


def run(engine, work: list[list[int]], concurrency: int, params) -> Run:
    """Every prompt of `work`, `concurrency` in flight at a time; outputs in prompt order."""
    spec = engine.speculation
    before = (0, 0, 0) if spec is None else (spec.num_draft_tokens, spec.num_accepted_tokens, spec.num_verified_rows)
    queue = list(enumerate(work))
    requests: dict[int, object] = {}
    active = 0
    started = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        while queue and active < concurrency:
            i, prompt = queue.pop(0)
            requests[i] = engine.add_request(prompt, params)
            active += 1
        for update in engine.step():
            if update.finished:
                active -= 1
    seconds = time.perf_counter() - started
    tokens = [list(requests[i].output_token_ids) for i in range(len(work))]
    result = Run(seconds, sum(map(len, tokens)), tokens)
    if spec is not None:
        result.drafted = spec.num_draft_tokens - before[0]
        result.accepted = spec.num_accepted_tokens - before[1]
        result.verified_rows = spec.num_verified_rows - before[2]
    return result


def format_table(rows: list[tuple[int, Run, Run]]) -> str:
    head = (
        f"{'concurrency':>11} {'base tok/s':>10} {'spec tok/s':>10} {'speed-up':>8} {'accept len':>10} "
        f"{'drafted':>8} {'accepted':>8} {'same tokens':>11}"
    )
    lines = [head, "-" * len(head)]
    for c, base, spec in rows:
        lines.append(
            f"{c:>11} {base.tokens_per_s:>10.1f} {spec.tokens_per_s:>10.1f} "
            f"{spec.tokens_per_s / (base.tokens_per_s or 1.0):>7.2f}x {spec.acceptance_length:>10.2f} "
            f"{spec.drafted:>8} {spec.accepted:>8} {str(base.tokens == spec.tokens):>11}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from jaxllm.bench.tiny_mtp import tiny_deepseek_mtp
    from jaxllm.cli.args import HelpFormatter
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine
    from jaxllm.llm_args import KvCacheConfig
    from jaxllm.sampling import SamplingParams
    from jaxllm.speculative_config import (
        DraftTargetDecodingConfig,
        EagleDecodingConfig,
        MTPDecodingConfig,
        NGramDecodingConfig,
        SpeculativeConfig,
    )

    parser = argparse.ArgumentParser(
        prog="jaxllm bench spec",
        formatter_class=HelpFormatter,
        description="Speculative decoding next to the same engine without it, on a workload whose output "
        "repeats its input: output tokens/s, speed-up and mean acceptance length per concurrency.",
    )
    parser.add_argument("--method", default="ngram", choices=["ngram", "mtp", "draft", "eagle3"])
    parser.add_argument(
        "--model", default=None, help="default: smollm2 (ngram), a tiny random DeepSeek-V3 with one MTP layer (mtp)"
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated requests in flight")
    parser.add_argument("--requests", type=int, default=0, help="requests per concurrency (0: max(4, 2 x it))")
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--max-draft-len", type=int, default=4)
    parser.add_argument("--max-matching-ngram-size", type=int, default=3)
    parser.add_argument(
        "--draft-model", default=None, help="draft: the draft model (default: the target itself); eagle3: the head"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--max-num-tokens", type=int, default=256)
    parser.add_argument(
        "--min-token-bucket", type=int, default=8, help="smallest token bucket (a verifying row of 1 + k tokens fits 8)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs of each engine per concurrency, alternating; the fastest counts"
    )
    parser.add_argument(
        "--no-adaptive",
        action="store_true",
        help="every eligible row drafts every step (no per-step fallback), as a peer for the adaptive policy",
    )
    args = parser.parse_args(argv)
    if args.model is None:
        args.model = {"ngram": "smollm2", "draft": "tiny-moe"}.get(args.method) or str(tiny_deepseek_mtp(args.seed))
        if args.method == "eagle3":
            parser.error("--method eagle3 needs --model (a Llama-style target) and --draft-model (its EAGLE-3 head)")
    if args.method == "eagle3" and not args.draft_model:
        parser.error("--method eagle3 needs --draft-model (the EAGLE-3 head's directory)")
    levels = [int(c) for c in args.concurrency.split(",")]
    if any(c < 1 for c in levels):
        parser.error("--concurrency values must be >= 1")

    config = dict(
        model=args.model,
        dtype=args.dtype,
        max_batch_size=max(levels),
        max_num_tokens=args.max_num_tokens,
        min_token_bucket=args.min_token_bucket,
        max_seq_len=1024,
        seed=args.seed,
        kv_cache_config=KvCacheConfig(tokens_per_block=32, max_tokens=max(levels) * 1024 + 1024),
    )
    speculative: SpeculativeConfig = NGramDecodingConfig(
        max_draft_len=args.max_draft_len, max_matching_ngram_size=args.max_matching_ngram_size
    )
    detail = f"max_draft_len {args.max_draft_len}, max_matching_ngram_size {args.max_matching_ngram_size}"
    if args.method == "mtp":
        speculative = MTPDecodingConfig(num_nextn_predict_layers=args.max_draft_len)
        detail = f"num_nextn_predict_layers {args.max_draft_len}"
    elif args.method in ("draft", "eagle3"):
        draft_dir = args.draft_model or args.model
        cls = DraftTargetDecodingConfig if args.method == "draft" else EagleDecodingConfig
        speculative = cls(max_draft_len=args.max_draft_len, speculative_model_dir=draft_dir)
        detail = f"max_draft_len {args.max_draft_len}, draft {draft_dir}"
    params = SamplingParams(
        max_tokens=args.output_len, temperature=args.temperature, seed=args.seed if args.temperature else None
    )
    engines = {}
    for name, spec_config in (("base", None), ("spec", speculative)):
        engine = LLMEngine(EngineConfig(**config, speculative_config=spec_config))
        engine.warmup(all_variants=args.temperature > 0)
        if engine.speculation is not None and args.no_adaptive:
            engine.speculation.adaptive = False
        engines[name] = engine
    tokenizer = engines["base"].tokenizer
    rows = []
    for c in levels:
        count = args.requests or max(4, 2 * c)
        work = prompts(tokenizer, count)
        runs: dict[str, list[Run]] = {"base": [], "spec": []}
        for _ in range(max(1, args.repeats)):  # alternating, so a change of machine load hits both
            for name in ("base", "spec"):
                runs[name].append(run(engines[name], work, c, params))
        base, spec = (max(runs[name], key=lambda r: r.tokens_per_s) for name in ("base", "spec"))
        rows.append((c, base, spec))
    for engine in engines.values():
        engine.close()
    lengths = [len(p) for p in prompts(tokenizer, len(TEXTS) * len(TASKS))]
    print(
        f"model {args.model}, method {args.method} ({detail}{', no adaptive fallback' if args.no_adaptive else ''}), "
        f"temperature {args.temperature}, "
        f"output {args.output_len} tokens, "
        f"prompts {min(lengths)}-{max(lengths)} tokens (rewrite / extract / copy code)"
    )
    print(format_table(rows))
    same = all(base.tokens == spec.tokens for _, base, spec in rows)
    if args.temperature == 0:
        print(f"greedy outputs identical with and without speculation: {same}")
        return 0 if same else 1
    return 0
