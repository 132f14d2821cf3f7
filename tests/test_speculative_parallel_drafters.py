"""A draft model and an EAGLE-3 head drafting for a target under tensor and expert parallelism
(2 fake CPU devices, in a subprocess; see tests/multidevice.py): the tiny Qwen3-MoE target at
TP 2 with EP 2 (attention heads split, experts dispatched to the rank owning each), its drafter's
weights and page pool on the same mesh. Greedy output is token-for-token the single-device
engine's without speculation, under requests joining while others run and a chunked long prompt.

The same under attention data parallelism (2 ranks, experts split 2 ways): each drafter keeps one
page pool per rank (a leading rank axis split over the devices, addressed by that rank's block
ids) and drafts each rank's rows on its device; the EAGLE-3 head's drafts are those it proposes
on one device for the same tokens (the ranks' steps differ from one device's).

The draft model is the target's own checkpoint, so most drafts are accepted unless the drafter's
sharded forward is wrong. The EAGLE-3 head is random, in the published layout, fusing
target layers 0, 1 and 2 (`eagle_aux_hidden_state_layer_ids`): its drafts under TP 2 / EP 2 are
those it proposes on one device (checked against torch in tests/test_eagle3_engine.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.multidevice import FAST_COMPILE, run_on_cpu_devices
from tests.test_speculative_parallel import MAX_TOKENS, _run

EP2 = dict(tensor_parallel_size=2, moe_expert_parallel_size=2)
DP = dict(EP2, enable_attention_dp=True)
RUNS = [("base", {}), ("draft_model", EP2), ("eagle3", {}), ("eagle3", EP2), ("draft_model", DP), ("eagle3", DP)]


def write_head(root: Path) -> Path:
    """A random EAGLE-3 head for tiny-moe (hidden 128, vocabulary 453) in its published layout."""
    import numpy as np
    import torch
    import transformers
    from safetensors.torch import save_file

    from jaxllm.models import materialize_preset
    from tests.test_eagle3 import HEAD, TorchEagle3, _randomize

    target = json.loads((materialize_preset("tiny-moe") / "config.json").read_text())
    head = dict(
        HEAD,
        vocab_size=target["vocab_size"],
        hidden_size=target["hidden_size"],
        intermediate_size=2 * target["hidden_size"],
        draft_vocab_size=120,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
    )
    config = transformers.LlamaConfig(**head)
    config._attn_implementation = "eager"
    hot = np.sort(np.random.default_rng(1).choice(head["vocab_size"], head["draft_vocab_size"], replace=False))
    torch.manual_seed(1)
    module = TorchEagle3(config, head["draft_vocab_size"], hot).eval()
    _randomize(module, torch.Generator().manual_seed(1))
    out = root / "head"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(head))
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(out / "model.safetensors"))
    return out


def check_all(root: Path) -> None:
    """Subprocess entry point (2 devices)."""
    import jax

    from jaxllm.models import materialize_preset
    from jaxllm.speculative_config import DraftTargetDecodingConfig, EagleDecodingConfig
    from tests.spec_helpers import small_spec_engine

    assert len(jax.devices()) == 2
    methods = {
        "base": None,
        "draft_model": DraftTargetDecodingConfig(
            max_draft_len=3, speculative_model_dir=str(materialize_preset("tiny-moe"))
        ),
        "eagle3": EagleDecodingConfig(max_draft_len=3, speculative_model_dir=str(root / "head")),
    }
    for name, layout in RUNS:
        engine = small_spec_engine("tiny-moe", methods[name], **layout)
        try:
            result = _run(engine)
            leaf = jax.tree_util.tree_leaves(engine.speculation.drafter.params)[0] if name != "base" else None
            result["drafter_devices"] = 0 if leaf is None else len(leaf.sharding.device_set)
            if name != "base":  # the drafter's page pool: [ranks, ...] under attention DP
                result["pool_shape"] = list(jax.tree_util.tree_leaves(engine.speculation.drafter.cache)[0].shape)
            kv = engine.kv_cache_manager
            result.update(free=int(kv.num_free_blocks), total=int(kv.num_blocks))
        finally:
            engine.close()
        print(
            json.dumps(dict(name=name, parallel=bool(layout), dp=bool(layout.get("enable_attention_dp")), **result)),
            flush=True,
        )


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("drafters")
    write_head(root)
    lines = run_on_cpu_devices(
        "test_speculative_parallel_drafters", "check_all", root, num_devices=2, xla_flags=FAST_COMPILE
    )
    assert [r["name"] for r in lines] == [name for name, _ in RUNS]
    return lines


def test_draft_model_and_eagle3_under_tp_and_ep_keep_the_one_device_greedy_output(results):
    base, draft, eagle_one, eagle = results[:4]
    assert [len(t) for t in base["tokens"]] == MAX_TOKENS
    for r in (draft, eagle_one, eagle):
        case = f"{r['name']} {'at TP 2 / EP 2' if r['parallel'] else 'on one device'}"
        assert r["tokens"] == base["tokens"], f"{case}: tokens differ from one device without speculation"
        assert r["drafted"] > 30, case
    assert draft["drafter_devices"] == eagle["drafter_devices"] == 2  # the drafters' weights live on the mesh
    # The target drafting for itself: 34 of 42 drafts accepted on one device with this workload
    # (a draft whose positions the drafter's pool missed, or past a near-tie, is rejected); a
    # wrongly sharded draft forward accepts next to none.
    assert draft["accepted"] >= 0.75 * draft["drafted"], draft
    assert draft["steps"] < base["steps"]
    assert eagle["proposals"] == eagle_one["proposals"]


def test_draft_model_and_eagle3_under_attention_dp_keep_the_one_device_greedy_output(results):
    base, _, eagle_one, _, draft, eagle = results
    for r in (draft, eagle):
        case = f"{r['name']} under attention DP"
        assert r["dp"] and r["tokens"] == base["tokens"], f"{case}: tokens differ from one device without speculation"
        assert r["drafted"] > 30, case
        assert r["pool_shape"][0] == 2, f"{case}: one drafter pool per rank"
        assert r["free"] == r["total"], f"{case}: KV blocks were not returned to their ranks' pools"
    # The target drafting for itself: a wrongly laid out per-rank draft forward accepts next to none.
    assert draft["accepted"] >= 0.75 * draft["drafted"], draft
    assert draft["steps"] < base["steps"]
    # The ranks' steps differ from one device's, the drafts for the same tokens do not (their
    # lengths may: each rank drafts within its own token budget).
    one = {tuple(tokens): drafts for tokens, drafts in eagle_one["proposals"] if drafts}
    dp = {tuple(tokens): drafts for tokens, drafts in eagle["proposals"] if drafts}
    common = [k for k in dp if k in one]
    assert len(common) > 20, len(common)
    differ = [(dp[k], one[k]) for k in common if dp[k][: len(one[k])] != one[k][: len(dp[k])]]
    assert not differ, differ
