"""N-gram speculative decoding with attention data parallelism (4 fake CPU devices, one
subprocess; see tests/multidevice.py), on a tiny Qwen3-MoE checkpoint.

Four attention-DP ranks (experts split 2 ways) each schedule their own requests, pack their
rows' drafts after the last token and verify them from their own packed tokens' logits;
greedy output must be token for token the single-device engine's without speculation, with
requests joining while others run, a chunked prompt sharing steps with verifying rows, long
accepted runs (the prompts repeat phrases, which the greedy outputs then loop on), a row with a
repetition penalty drafting, rows of several ranks drafting in the same step, and drafting
decided by the adaptive policy too. Nothing compiles after the warm-up, and every KV block
goes back to its rank's pool.
MTP under attention DP: tests/test_attention_dp_mla.py; draft models and EAGLE-3:
tests/test_speculative_attention_dp_drafters.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.multidevice import FAST_COMPILE, run_on_cpu_devices
from tests.spec_helpers import COMPILE_EVENT

MAX_TOKENS = [24, 12, 20, 10, 16]
DP = dict(tensor_parallel_size=4, moe_expert_parallel_size=2, enable_attention_dp=True)
RUNS = [("base", {}), ("ngram", DP), ("adaptive", DP)]


def _prompts(vocab: int) -> list[list[int]]:
    """In arrival order: repeated 4-token phrases, a long prompt (chunked), a short one."""
    import numpy as np

    rng = np.random.default_rng(1)
    phrases = [[int(t) for t in rng.integers(3, vocab, 4)] for _ in range(4)]
    return [
        phrases[0] * 4,
        [int(t) for t in rng.integers(3, vocab, 45)],
        phrases[1] * 3,
        phrases[2] * 4 + [7],
        phrases[3][:2] + [5, 6, 7],
    ]


def _run(engine, adaptive: bool = False) -> dict:
    """Greedy tokens per arrival, a request joining every second step; with speculation every
    step drafts unless `adaptive` (drafting decided by the measured step costs), and the ranks
    of the rows each step verified."""
    import numpy as np

    from jaxllm import SamplingParams

    spec = engine.speculation
    ranks_per_step: list[list[int]] = []
    penalized_drafts = [0]  # drafts of the row with a repetition penalty
    if spec is not None:
        spec.adaptive = adaptive
        prepare = spec.prepare

        def recording(plan, output, drafts):
            plan, verify = prepare(plan, output, drafts)
            if verify is not None:
                ranks_per_step.append(sorted({row // spec.max_batch_size for row in verify[0]}))
            for request in output.generation_requests:
                if request.sampling_params.repetition_penalty != 1.0:
                    penalized_drafts[0] += len(drafts.get(request.request_id, ()))
            return plan, verify

        spec.prepare = recording
    pending = list(zip(_prompts(engine.model_config.vocab_size), MAX_TOKENS))
    results: dict[int, list[int]] = {}
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and steps % 2 == 0:
            prompt, max_tokens = pending.pop(0)
            # The third request has a repetition penalty (its entries see the drafts before them).
            penalty = 1.3 if len(pending) == 2 else 1.0
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, repetition_penalty=penalty)
            results[engine.add_request(prompt, params).request_id] = []
        for update in engine.step():
            results[update.request.request_id] += update.new_token_ids
        steps += 1
        assert steps < 400
    kv = engine.kv_cache_manager
    kv.check_invariants()
    out = dict(tokens=list(results.values()), steps=steps, free=int(kv.num_free_blocks), total=int(kv.num_blocks))
    if spec is not None:
        out.update(
            drafted=spec.num_draft_tokens,
            accepted=spec.num_accepted_tokens,
            ranks_per_step=ranks_per_step,
            penalized_drafts=penalized_drafts[0],
            max_accepted=int(np.nonzero(spec.num_accepted_per_pos)[0].max(initial=-1)) + 1,
        )
    return out


def check_all(root: Path) -> None:
    """Subprocess entry point (4 devices)."""
    import jax

    from jaxllm.models import materialize_preset
    from jaxllm.speculative_config import NGramDecodingConfig
    from tests.spec_helpers import small_spec_engine

    assert len(jax.devices()) == 4
    for name, layout in RUNS:
        ngram = NGramDecodingConfig(max_draft_len=3, max_matching_ngram_size=2) if layout else None
        engine = small_spec_engine(
            str(root / "qwen3_moe"), ngram, tokenizer=str(materialize_preset("tiny-moe")), **layout
        )
        compiles: list[str] = []

        def listener(event, duration, **kwargs):
            if event == COMPILE_EVENT:
                compiles.append(event)

        try:
            if name == "ngram":  # everything a drafting step runs compiles in the warm-up
                engine.warmup()
            jax.monitoring.register_event_duration_secs_listener(listener)
            try:
                result = _run(engine, adaptive=name == "adaptive")
            finally:
                jax.monitoring.unregister_event_duration_listener(listener)
        finally:
            engine.close()
        result["compiles"] = len(compiles)
        print(json.dumps(dict(name=name, **result)), flush=True)


def test_ngram_greedy_output_under_attention_dp_equals_one_device_without_speculation(tmp_path):
    from tests.test_ep_moe import write_checkpoint

    write_checkpoint("qwen3_moe", tmp_path / "qwen3_moe", seed=5, vocab_size=256)
    results = run_on_cpu_devices(
        "test_speculative_attention_dp", "check_all", tmp_path, num_devices=4, xla_flags=FAST_COMPILE
    )
    assert [r["name"] for r in results] == [name for name, _ in RUNS]
    base, ngram, adaptive = results
    assert [len(t) for t in base["tokens"]] == MAX_TOKENS
    assert ngram["tokens"] == base["tokens"], "tokens differ from one device without speculation"
    assert adaptive["tokens"] == base["tokens"], "adaptive drafting: tokens differ"
    assert ngram["accepted"] >= 10 and ngram["max_accepted"] >= 2, ngram
    assert ngram["steps"] < base["steps"]
    assert any(len(ranks) > 1 for ranks in ngram["ranks_per_step"]), "no step verified rows of several ranks"
    assert ngram["penalized_drafts"] > 0, "the row with a repetition penalty never drafted"
    assert ngram["free"] == ngram["total"] and base["free"] == base["total"]
    assert ngram["compiles"] == 0, "a program compiled after the warm-up"
