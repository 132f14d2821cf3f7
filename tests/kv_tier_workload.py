"""A workload whose reusable prefixes do not fit the device KV pool: several long prefixes,
each asked again in later waves with a new tail (host KV tier tests)."""

from __future__ import annotations

import numpy as np


def interleaved_prefixes(
    engine, *, num_prefixes: int, prefix_len: int, waves: int, vocab: int, max_tokens: int = 4, seed: int = 0, step=None
) -> list[list[int]]:
    """Run `waves` waves of one request per prefix (greedy); returns every request's tokens.
    `step(engine)` runs after every engine step (checks)."""
    from jaxllm.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    prefixes = [[int(t) for t in rng.integers(3, vocab, prefix_len)] for _ in range(num_prefixes)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs = []
    for wave in range(waves):
        requests = [engine.add_request(p + [3 + wave, 3 + i], params) for i, p in enumerate(prefixes)]
        while engine.has_unfinished_requests():
            engine.step()
            if step is not None:
                step(engine)
        outputs += [list(r.output_token_ids) for r in requests]
    return outputs


def context_tokens(engine) -> int:
    """Prompt tokens the engine computed (prefix hits excluded)."""
    return sum(s["inflightBatchingStats"]["numCtxTokens"] for s in engine.iteration_stats)
