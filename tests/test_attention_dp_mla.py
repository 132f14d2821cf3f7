"""Attention data parallelism for DeepSeek-V3 (multi-head latent attention) on 4 fake CPU
devices (one subprocess, see tests/multidevice.py), on the tiny DeepSeek-V3 checkpoint with an
MTP layer (tests/mtp_helpers.py).

Each rank keeps its own latent page pool ([ranks, blocks, tokens, latent] split over the
devices), the MLA weights are replicated and the routed experts dispatched as under plain
expert parallelism (EP 4, and EP 2 x TP 2). On the staggered in-flight workload of
tests/test_deepseek.py (chunked prefill, prefill and decode in one step) the
engine gives exactly the single-device engine's greedy tokens, and the logits each token was
sampled from agree within 2e-6 of the largest logit. A prompt sent again once the ranks are
idle reuses its blocks cached in its rank's pool.

MTP speculative decoding under attention DP (EP 2 x TP 2, `num_nextn_predict_layers=2`: the
checkpoint's one MTP layer chained): each rank keeps its own MTP latent pool, drafts for its own
rows from their last accepted hidden states and verifies them from its own packed tokens. On
the workload of tests/test_speculative_parallel.py (requests joining while others run, a chunked
long prompt) greedy output is token for token the single-device engine's without speculation,
the drafts are the torch MTP chain's, and nothing compiles after the warm-up.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.multidevice import FAST_COMPILE, run_on_cpu_devices

MAX_TOKENS = 8
# (name, tensor_parallel_size, moe_expert_parallel_size): attention DP over 4 ranks.
DP_LAYOUTS = [("ep4", 4, 4), ("ep2-tp2", 4, 2)]


def _staggered(engine, arrivals: dict) -> dict[str, list[int]]:
    from tests.test_deepseek import _engine_outputs

    tokens = _engine_outputs(engine, arrivals, max_tokens=MAX_TOKENS)
    return {str(k): v for k, v in sorted(tokens.items())}


def check_all(root: Path) -> None:
    """Subprocess entry point (4 devices)."""
    import jax

    from jaxllm.engine.ranked_planner import RankAssignment
    from tests.parallel_workload import small_engine
    from tests.test_attention_dp import capture_logits
    from tests.test_deepseek import staggered_prompts

    assert len(jax.devices()) == 4
    directory = root / "ds"
    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    arrivals = staggered_prompts(vocab)
    # Once every request has finished (all ranks empty), the first prompt again: placed on
    # rank 0, whose pool still caches its blocks (prefix reuse within a rank).
    arrivals[24] = [arrivals[0][0]]
    placed: list[int] = []
    place = RankAssignment.place

    def record_place(self, request):
        known = request.request_id in self.rank_of
        rank = place(self, request)
        if not known:
            placed.append(rank)
        return rank

    RankAssignment.place = record_place
    base_logits: dict = {}
    for name, tp, ep in [("base", 1, 1)] + DP_LAYOUTS:
        layout = {} if name == "base" else dict(tensor_parallel_size=tp, moe_expert_parallel_size=ep)
        engine = small_engine(directory, directory, enable_attention_dp=name != "base", **layout)
        logits = capture_logits(engine)
        placed.clear()
        try:
            tokens = _staggered(engine, arrivals)
            kv = engine.kv_cache_manager
            kv.check_invariants()
            if name == "base":
                base_logits = logits
            err = max(float(np.abs(logits[k] - base_logits[k]).max()) for k in base_logits)
            scale = max(float(np.abs(v).max()) for v in base_logits.values())
            mixed = any(
                s["inflightBatchingStats"]["numContextRequests"] and s["inflightBatchingStats"]["numGenRequests"]
                for s in engine.iteration_stats
            )
            cache = engine.runner.kv_cache
            result = dict(
                name=name,
                tokens=tokens,
                err=err,
                scale=scale,
                reused_blocks=int(kv.get_kv_cache_stats().reused_blocks),
                same_keys=sorted(logits) == sorted(base_logits),
                ranks=sorted(set(placed)),
                mixed=mixed,
                kv_shape=list((cache[0] if isinstance(cache, list) else cache).latent.shape),
                free=int(kv.num_free_blocks),
                total=int(kv.num_blocks),
            )
        finally:
            engine.close()
        print(json.dumps(result), flush=True)
    check_mtp(root)


def check_mtp(root: Path) -> None:
    """MTP under attention DP against one device without speculation (same subprocess)."""
    import jax

    from jaxllm.speculative_config import MTPDecodingConfig
    from tests.spec_helpers import COMPILE_EVENT, small_spec_engine
    from tests.test_speculative_parallel import _run

    dp = dict(tensor_parallel_size=4, moe_expert_parallel_size=2, enable_attention_dp=True)
    for name, method, layout in (("spec-base", None, {}), ("mtp", MTPDecodingConfig(num_nextn_predict_layers=2), dp)):
        engine = small_spec_engine(str(root / "ds"), method, **layout)
        compiles: list[str] = []

        def listener(event, duration, **kwargs):
            if event == COMPILE_EVENT:
                compiles.append(event)

        try:
            if method is not None:
                engine.warmup(all_variants=False)
            jax.monitoring.register_event_duration_secs_listener(listener)
            try:
                result = _run(engine)
            finally:
                jax.monitoring.unregister_event_duration_listener(listener)
            kv = engine.kv_cache_manager
            result.update(free=int(kv.num_free_blocks), total=int(kv.num_blocks), compiles=len(compiles))
            if method is not None:
                result.update(
                    mtp_pool=list(engine.speculation.drafter.cache.latent.shape),
                    steps_run=engine.speculation.drafter.steps_run,
                )
        finally:
            engine.close()
        if method is None:
            result.pop("proposals", None)
        print(json.dumps(dict(name=name, **result)), flush=True)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.mtp_helpers import write_engine_checkpoint

    root = tmp_path_factory.mktemp("attention_dp_mla")
    (root / "ds").mkdir()
    model, mtp = write_engine_checkpoint(root / "ds")
    lines = run_on_cpu_devices("test_attention_dp_mla", "check_all", root, num_devices=4, xla_flags=FAST_COMPILE)
    return lines, model, mtp


def test_mla_under_attention_dp_gives_the_single_device_tokens(results):
    by_name = {r["name"]: r for r in results[0]}
    assert sorted(by_name) == sorted(["base", "spec-base", "mtp"] + [name for name, _, _ in DP_LAYOUTS])
    base = by_name["base"]
    assert len(base["tokens"]) == 6 and all(len(t) == MAX_TOKENS for t in base["tokens"].values())
    for name, _, _ in DP_LAYOUTS:
        r = by_name[name]
        assert r["tokens"] == base["tokens"], f"{name}: greedy tokens differ from one device"
        # float32 sums in another order: within 2e-6 of the largest logit (about 12 here)
        assert r["same_keys"] and r["err"] < 2e-6 * r["scale"], f"{name}: logits differ by {r['err']}"
        assert r["kv_shape"][0] == 4, f"{name}: one latent block pool per rank"
        assert len(r["ranks"]) >= 3, f"{name}: requests placed on ranks {r['ranks']}"
        assert r["mixed"], f"{name}: no step mixed prefill and decode"
        assert r["reused_blocks"] > 0, f"{name}: no prefix was reused"
        assert r["free"] == r["total"], f"{name}: KV blocks were not returned to their ranks' pools"


def test_mtp_under_attention_dp_gives_the_single_device_tokens_without_speculation(results):
    from tests.mtp_helpers import torch_mtp_drafts
    from tests.test_speculative_parallel import MAX_TOKENS as SPEC_MAX_TOKENS

    lines, model, mtp_layer = results
    by_name = {r["name"]: r for r in lines}
    base, mtp = by_name["spec-base"], by_name["mtp"]
    assert [len(t) for t in base["tokens"]] == SPEC_MAX_TOKENS
    assert mtp["tokens"] == base["tokens"], "MTP under attention DP: tokens differ from one device"
    assert mtp["mtp_pool"][0] == 4, "one MTP latent pool per rank"
    assert mtp["free"] == mtp["total"], "KV blocks were not returned to their ranks' pools"
    assert mtp["compiles"] == 0, "a program compiled after the warm-up"
    # Drafts were made and verified; the random MTP layer predicts the random target's tokens
    # no better than chance (on one device too), so the drafts are checked against the torch MTP
    # chain run from scratch over each sequence (ties within 1e-4 allowed; the second draft
    # where the first is the chain's argmax), as tests/test_speculative_parallel.py does.
    drafted = [(tokens, drafts) for tokens, drafts in mtp["proposals"] if drafts]
    assert mtp["drafted"] > 20 and len(drafted) > 20, mtp["drafted"]
    assert mtp["steps_run"] > 10
    for tokens, drafts in drafted[::3]:
        chain = torch_mtp_drafts(model, mtp_layer, tokens, 2)
        assert chain[0][drafts[0]] >= chain[0].max() - 1e-4, (tokens, drafts)
        if len(drafts) > 1 and int(chain[0].argmax()) == drafts[0]:
            assert chain[1][drafts[1]] >= chain[1].max() - 1e-4, (tokens, drafts)
