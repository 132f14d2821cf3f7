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


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.mtp_helpers import write_engine_checkpoint

    root = tmp_path_factory.mktemp("attention_dp_mla")
    (root / "ds").mkdir()
    write_engine_checkpoint(root / "ds")
    return run_on_cpu_devices("test_attention_dp_mla", "check_all", root, num_devices=4, xla_flags=FAST_COMPILE)


def test_mla_under_attention_dp_gives_the_single_device_tokens(results):
    by_name = {r["name"]: r for r in results}
    assert sorted(by_name) == sorted(["base"] + [name for name, _, _ in DP_LAYOUTS])
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
