"""Layer stacks run as lax.scan: the program does not grow with depth, the page pool is updated
in place, and the results equal the per-layer loop's (scan_layers=False), which the HF
parity tests cover on their own."""

from __future__ import annotations

import re
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.models import ModelConfig, forward, init_kv_cache, load_params, param_shapes
from jaxllm.models.decoder import forward_with_moe_stats
from jaxllm.models.random_checkpoint import random_checkpoint
from jaxllm.models.weights import layer_stacks
from tests.model_helpers import PagedModel, SeqChunk, build_step_batch


def tiny_config(num_layers: int, *, moe: bool, scan: bool = True) -> ModelConfig:
    """Qwen3 (dense) or Qwen3-MoE whose first layer is dense (dense-then-MoE: two layer kinds)."""
    extra = (
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=(0,))
        if moe
        else {}
    )
    return ModelConfig(
        architecture="Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        qk_norm=True,
        attention_bias=False,
        sliding_window=None,
        scan_layers=scan,
        **extra,
    )


def _batch():
    return build_step_batch(
        [SeqChunk([5, 6, 7], 0, [2, 0]), SeqChunk([9], 4, [1, 3])],
        tokens_per_block=4,
        num_blocks=8,
        token_bucket=16,
        max_seqs=2,
        max_blocks_per_seq=4,
    )


def _lowered(config: ModelConfig):
    """The forward lowered from shapes alone (no weights, no compilation)."""
    cache = jax.eval_shape(lambda: init_kv_cache(config, 8, 4, jnp.float32))
    return jax.jit(forward, static_argnames="config", donate_argnums=(1,)).lower(
        param_shapes(config), cache, _batch(), config=config
    )


def _num_ops(config: ModelConfig) -> int:
    return len(_lowered(config).as_text().splitlines())


def test_program_size_does_not_grow_with_depth():
    # Dense: one stack; dense-then-MoE: two stacks (first layer dense, then 2 or 8 MoE layers).
    for moe, shallow, deep in ((False, 2, 8), (True, 3, 9)):
        scanned = _num_ops(tiny_config(shallow, moe=moe)), _num_ops(tiny_config(deep, moe=moe))
        unrolled = (
            _num_ops(tiny_config(shallow, moe=moe, scan=False)),
            _num_ops(tiny_config(deep, moe=moe, scan=False)),
        )
        assert scanned[0] == scanned[1], (moe, scanned)
        assert unrolled[1] > 2.5 * unrolled[0], (moe, unrolled)  # what the scan removes
        assert scanned[1] < unrolled[1] / 2


def test_page_pool_is_updated_in_place():
    config = tiny_config(9, moe=True)
    pool = jax.eval_shape(lambda: init_kv_cache(config, 8, 4, jnp.float32))
    assert pool.k.shape == (2, 9 * 8, 4, 16)
    hlo = _lowered(config).compile().as_text()
    pool_type = r"f32\[2,72,4,16\]"
    assert not re.search(pool_type + r"\{[^}]*\} copy\(", hlo), "the step copies the whole page pool"
    header = hlo.splitlines()[0]
    # The donated pool (k and v: outputs 1 and 2) aliases its input buffers.
    assert re.search(
        r"input_output_alias=\{ \{1\}: \(\d+, \{\}, may-alias\), \{2\}: \(\d+, \{\}, may-alias\) \}", header
    ), header


def test_layer_stacks_split_by_kind_and_slot_layers():
    config = tiny_config(5, moe=True)
    assert [(s.start, s.stop) for s in layer_stacks(config)] == [(0, 1), (1, 5)]
    assert [(s.start, s.stop) for s in layer_stacks(config, unstacked=(2,))] == [(0, 1), (1, 2), (3, 5)]
    assert layer_stacks(replace(config, scan_layers=False)) == ()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from safetensors.numpy import save_file

    config = tiny_config(4, moe=True)
    directory = tmp_path_factory.mktemp("scan")
    save_file(random_checkpoint(config, seed=3), str(directory / "model.safetensors"))
    return config, directory


def _greedy(model: PagedModel, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Prefill `prompt` (blocks 5, 2, 7, 0), then `steps` greedy decode steps: tokens and logits."""
    table = [5, 2, 7, 0]
    logits, model.cache = model.forward([SeqChunk(prompt, 0, table)])
    tokens, all_logits = [int(np.argmax(logits[0]))], [logits[0]]
    for step in range(steps):
        logits, model.cache = model.forward([SeqChunk([tokens[-1]], len(prompt) + step, table)])
        tokens.append(int(np.argmax(logits[0])))
        all_logits.append(logits[0])
    return tokens, all_logits


def test_scan_equals_per_layer_loop(checkpoint):
    config, directory = checkpoint
    loop_config = replace(config, scan_layers=False)
    prompt = [3, 17, 99, 42, 7, 64, 11]
    ref_tokens, ref_logits = _greedy(PagedModel(load_params(directory, loop_config), loop_config), prompt, 4)
    params = load_params(directory, config)
    assert params["layers"] == [{}] * 4 and len(params["layer_stacks"]) == 2
    tokens, logits = _greedy(PagedModel(params, config), prompt, 4)
    assert tokens == ref_tokens
    np.testing.assert_allclose(np.stack(logits), np.stack(ref_logits), rtol=1e-6, atol=1e-6)
    # The expert counts per MoE layer (layers 1-3 of the scanned stack) are the loop's.
    batch = _batch()
    stats_fn = jax.jit(forward_with_moe_stats, static_argnames="config")
    _, _, stats = stats_fn(params, init_kv_cache(config, 8, 4, jnp.float32), batch, config=config)
    _, _, ref_stats = stats_fn(
        load_params(directory, loop_config), init_kv_cache(loop_config, 8, 4, jnp.float32), batch, config=loop_config
    )
    assert stats.expert_counts.shape == (3, 8)
    np.testing.assert_array_equal(stats.expert_counts, ref_stats.expert_counts)


def test_slot_layers_stack_and_a_balancer_round_rewrites_one_layer_in_place(checkpoint):
    """Experts stored as slots (12 slots over 8 experts) stack like other MoE layers: slot
    buffers [3, 12, ...], tables [3, ...], the loop's tokens. A balancer round rewrites layer
    2's row in place (the stack donated, the other rows untouched, the table row replaced)
    compiling nothing after warm-up, and the next steps still give the loop's tokens."""
    from jaxllm.bench.request_metrics import counting_compiles
    from jaxllm.engine.load_balancer import OnlineLoadBalancer, moe_layer_params, slot_layer_row
    from sharding.eplb.eplb_config import MoeLoadBalancerConfig
    from sharding.eplb.online import PlacementUpdate
    from sharding.mesh import ParallelConfig, make_mesh

    config, directory = checkpoint
    placement = {i: np.concatenate([np.roll(np.arange(8), i), np.arange(4) + i]) for i in (1, 2, 3)}
    params = load_params(directory, config, slot_assignments=placement)
    assert params["layers"] == [{}] * 4 and len(params["layer_stacks"]) == 2
    moe = params["layer_stacks"][1]["moe"]
    assert moe["w_gate"].shape == (3, 12, 64, 32) and moe["slots"].slot_to_expert.shape == (3, 12)
    assert moe_layer_params(params, 2) is moe and slot_layer_row(params, 2) == 1
    prompt = [3, 17, 99, 42, 7, 64, 11]
    loop_config = replace(config, scan_layers=False)
    ref_tokens, ref_logits = _greedy(PagedModel(load_params(directory, loop_config), loop_config), prompt, 4)
    tokens, logits = _greedy(PagedModel(params, config), prompt, 2)
    assert tokens == ref_tokens[:3]
    np.testing.assert_allclose(np.stack(logits), np.stack(ref_logits[:3]), rtol=1e-5, atol=1e-5)

    balancer = OnlineLoadBalancer(
        config=MoeLoadBalancerConfig(num_slots=12, layer_updates_per_iter=3),
        params=params,
        moe_layers=[1, 2, 3],
        num_experts=8,
        ep_size=1,
        mesh=make_mesh(ParallelConfig()),
    )
    try:
        balancer.warm_up(params)
        before = {n: np.asarray(params["layer_stacks"][1]["moe"][n]) for n in ("w_gate", "w_down")}
        old = params["layer_stacks"][1]["moe"]["w_up"]
        new = np.concatenate([np.arange(8)[::-1], [5, 5, 6, 7]]).astype(np.int32)
        balancer.worker.offer(PlacementUpdate(2, new, placement[2], 1.0, 0.5, 12))
        with counting_compiles() as compiles:
            assert balancer.apply_round(params) == [2]
            moe = params["layer_stacks"][1]["moe"]
            jax.block_until_ready(moe)
        assert compiles == [], "a balancer round compiled a program after warm-up"
        assert old.is_deleted(), "the stacked slot buffer was not donated"
        np.testing.assert_array_equal(moe["slots"].slot_to_expert, np.stack([placement[1], new, placement[3]]))
        for name, rows in before.items():
            after = np.asarray(moe[name])
            np.testing.assert_array_equal(after[[0, 2]], rows[[0, 2]])  # the other layers' rows untouched
            changed = np.flatnonzero(new != placement[2])
            np.testing.assert_array_equal(after[1][changed], balancer.pool.rows(2, name)[new[changed]])
        model = PagedModel(params, config)
        model.cache = model.empty_cache()
        tokens, logits = _greedy(model, prompt, 4)
        assert tokens == ref_tokens
        np.testing.assert_allclose(np.stack(logits), np.stack(ref_logits), rtol=1e-5, atol=1e-5)
    finally:
        balancer.close()


def test_layouts_do_not_mix(checkpoint):
    config, directory = checkpoint
    params = load_params(directory, config)
    per_layer_cache = init_kv_cache(replace(config, scan_layers=False), 8, 4, jnp.float32)
    with pytest.raises(ValueError, match="page pool"):
        forward(params, per_layer_cache, _batch(), config=config)
    with pytest.raises(ValueError, match="layer stacks"):
        forward(params, init_kv_cache(config, 8, 4, jnp.float32), _batch(), config=replace(config, scan_layers=False))


def test_scan_layers_switch_reaches_the_engine_config():
    from jaxllm.cli import build_parser
    from jaxllm.cli.args import engine_kwargs
    from jaxllm.engine.engine_config import EngineConfig

    assert EngineConfig(model="tiny-moe").scan_layers
    assert "scan_layers" not in engine_kwargs(build_parser().parse_args(["generate"]))
    assert engine_kwargs(build_parser().parse_args(["generate", "--no-scan-layers"]))["scan_layers"] is False
