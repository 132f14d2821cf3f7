"""DeepSeek-V3's MTP layer under tensor parallelism and expert parallelism (its experts as slots,
dispatched to the rank owning each), on 2 fake CPU devices in a subprocess: fed
the target's final hidden states (transformers', written beside the checkpoint), it drafts the
same tokens with the same logits as on one device. (The hidden-state side output under tensor
parallelism is checked in `test_eagle3_tp.py`.)"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.multidevice import run_on_cpu_devices

NUM_DRAFTS = 2


def _drafts_mtp(directory: Path, mesh) -> tuple[list, np.ndarray]:
    import jax.numpy as jnp

    from jaxllm.models import load_model_config, load_params
    from jaxllm.models.mtp import init_mtp_kv_cache, mtp_draft
    from tests.mtp_helpers import NUM_BLOCKS, TOKENS_PER_BLOCK, draft_inputs, jitted

    config = load_model_config(directory)
    params = load_params(directory, config, mesh=mesh, load_mtp=True)
    _, draft, n = draft_inputs(config.vocab_size, 5)
    pre_norm = np.load(directory / "hidden.npy")
    hidden = jnp.zeros((draft.token_ids.shape[0], config.hidden_size)).at[:n].set(pre_norm)
    mtp_cache = init_mtp_kv_cache(config, NUM_BLOCKS, TOKENS_PER_BLOCK, "float32", mesh)
    drafts, _, logits = jitted(mtp_draft, "num_draft_tokens", "return_logits", "mesh")(
        params, mtp_cache, draft, hidden, num_draft_tokens=NUM_DRAFTS, config=config, mesh=mesh, return_logits=True
    )
    return np.asarray(drafts)[0].tolist(), np.asarray(logits)[0]


def check_all(root: Path) -> None:
    """Subprocess entry point (2 devices)."""
    import jax

    from sharding.mesh import ParallelConfig, make_mesh

    assert len(jax.devices()) == 2
    one_tokens, one_logits = _drafts_mtp(root / "ds", None)
    for name, parallel in (
        ("tp", ParallelConfig(tensor_parallel_size=2)),
        ("ep", ParallelConfig(tensor_parallel_size=2, moe_expert_parallel_size=2)),
    ):
        tokens, logits = _drafts_mtp(root / "ds", make_mesh(parallel))
        err = float(np.abs(logits - one_logits).max() / np.abs(one_logits).max())
        print(json.dumps(dict(name=name, one=one_tokens, tokens=tokens, err=err)), flush=True)


def test_mtp_drafts_under_tensor_and_expert_parallelism_match_one_device(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.mtp_helpers import draft_inputs, hf_with_mtp, saved_with, target_hidden

    model, mtp = hf_with_mtp()
    with saved_with(model, mtp):
        model.save_pretrained(tmp_path / "ds")
    target, _, n = draft_inputs(model.config.vocab_size, 5)
    _, pre_norm = target_hidden(model, [int(t) for t in target.token_ids[:n]])
    np.save(tmp_path / "ds" / "hidden.npy", pre_norm[0].numpy())
    results = run_on_cpu_devices("test_mtp_tp", "check_all", tmp_path, num_devices=2)
    assert [r["name"] for r in results] == ["tp", "ep"]
    for r in results:
        assert r["tokens"] == r["one"] and len(r["one"]) == NUM_DRAFTS, r
        assert r["err"] < 1e-4, r
