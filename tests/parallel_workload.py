"""The engine workload the parallel-layout tests share: a small engine, requests arriving over
several steps (long prompts chunked at 32 tokens, two prompts sharing a 24-token prefix the
cache already holds), and a hook that records every executed step plan."""

from __future__ import annotations

from pathlib import Path


def small_engine(directory: Path, tokenizer: Path, **engine_args):
    from jaxllm import KvCacheConfig
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine

    engine_args.setdefault("kv_cache_config", KvCacheConfig(tokens_per_block=8, max_tokens=512))
    return LLMEngine(
        EngineConfig(
            model=str(directory),
            tokenizer=str(tokenizer),
            dtype="float32",
            max_batch_size=4,
            max_num_tokens=32,
            max_seq_len=96,
            **engine_args,
        )
    )


def record_plans(engine) -> list:
    """From now on, every plan the engine's runner executes is kept with its `StepOutput`."""
    recorded: list = []
    execute = engine.runner.execute

    def record(plan):
        out = execute(plan)
        recorded.append((plan, out))
        return out

    engine.runner.execute = record
    return recorded


def run_staggered_requests(engine, seed: int = 11) -> dict[int, list[int]]:
    """Greedy tokens per request id of the scripted arrivals, run to completion."""
    import numpy as np

    from jaxllm import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size

    def prompt(n: int) -> list[int]:
        return [int(t) for t in rng.integers(3, vocab, n)]

    shared = prompt(24)
    arrivals = {0: [prompt(45), prompt(5)], 2: [shared + prompt(9)], 6: [shared + prompt(14), prompt(20)]}
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    outputs: dict[int, list[int]] = {}
    step = 0
    while step in arrivals or engine.has_unfinished_requests() or step < max(arrivals):
        for p in arrivals.get(step, []):
            engine.add_request(p, params)
        for update in engine.step():
            outputs.setdefault(update.request.request_id, []).extend(update.new_token_ids)
        step += 1
    return outputs
