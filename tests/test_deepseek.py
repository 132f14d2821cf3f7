"""DeepSeek-V3: multi-head latent attention over the paged latent cache, grouped sigmoid
routing with the correction bias, shared experts, against Hugging Face transformers
(tiny random f32 DeepseekV3ForCausalLM checkpoints), and in the engine."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxllm.kv_cache.spec import MhaKvCacheSpec, MlaKvCacheSpec  # noqa: E402
from jaxllm.models import (  # noqa: E402
    ModelConfig,
    kv_cache_bytes_per_token,
    load_model_config,
    load_params,
)
from tests.conftest import verified_triton_lowering  # noqa: E402
from tests.deepseek_helpers import TINY_DEEPSEEK_V3, randomize  # noqa: E402
from tests.model_helpers import PagedModel, SeqChunk, random_block_table, rel_err  # noqa: E402

TOL = 1e-4

BASE = TINY_DEEPSEEK_V3
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
    "rope_theta": 10000.0,
}
VARIANTS = {
    "q_lora": BASE,
    "plain_q_yarn": dict(BASE, q_lora_rank=None, n_shared_experts=2, norm_topk_prob=False, rope_parameters=YARN),
}
# The engine's model: 8 heads and 16 experts, for tensor and expert parallelism over 8 devices.
ENGINE = dict(
    BASE,
    num_hidden_layers=2,
    vocab_size=256,
    hidden_size=64,
    num_attention_heads=8,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=16,
    num_experts_per_tok=4,
    q_lora_rank=32,
    intermediate_size=128,
)


def build_hf(kwargs: dict, seed: int = 0, bias_scale: float = 0.2):
    """A random DeepseekV3ForCausalLM with decisive logits and a nonzero correction bias."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kwargs)).eval()
    randomize(model, torch.Generator().manual_seed(seed), bias_scale)
    return model


def write_checkpoint(directory: Path, kwargs: dict, seed: int = 0, tokenizer: bool = False):
    """Save a random DeepSeek-V3 checkpoint (and the tiny-moe tokenizer); returns the HF model."""
    import shutil

    from jaxllm.models import materialize_preset

    model = build_hf(kwargs, seed)
    model.save_pretrained(directory)
    if tokenizer:
        preset = materialize_preset("tiny-moe")
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (preset / name).exists():
                shutil.copy(preset / name, directory / name)
    return model


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([list(tokens)])).logits[0].double().numpy()


class Loaded:
    def __init__(self, variant: str, root: Path) -> None:
        self.dir = root / variant
        self.hf = write_checkpoint(self.dir, VARIANTS[variant])
        self.config = load_model_config(self.dir)
        self.params = load_params(self.dir, self.config)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    cache: dict[str, Loaded] = {}

    def get(variant: str) -> Loaded:
        if variant not in cache:
            cache[variant] = Loaded(variant, root)
        return cache[variant]

    return get


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, n)]


def test_config_reads_mla_routing_and_yarn(loaded):
    c = loaded("q_lora").config
    assert (c.architecture, c.kv_lora_rank, c.q_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (
        "DeepseekV3ForCausalLM",
        16,
        24,
        12,
        8,
        10,
    )
    assert (c.n_group, c.topk_group, c.routed_scaling_factor, c.n_shared_experts, c.scoring_func) == (
        4,
        2,
        2.5,
        1,
        "sigmoid",
    )
    assert [c.is_moe_layer(i) for i in range(3)] == [False, True, True] and c.rope_interleave
    assert c.rope_scaling is None and c.norm_topk_prob
    y = loaded("plain_q_yarn").config
    assert y.q_lora_rank is None and y.n_shared_experts == 2 and not y.norm_topk_prob
    assert y.rope_scaling.rope_type == "yarn" and y.rope_scaling.factor == 4.0 and y.rope_scaling.mscale == 0.707


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_logits_match_hf_absorbed_and_expanded(loaded, variant):
    m = loaded(variant)
    tokens = prompt(1, 13, m.config.vocab_size)
    ref = hf_logits(m.hf, tokens)
    assert ref.std() > 0.5, "test model has near-uniform logits"
    table = random_block_table(np.random.default_rng(0), 32, 8)
    out = {}
    for mode in ("absorbed", "expanded"):
        out[mode], _ = PagedModel(m.params, replace(m.config, mla_attention=mode)).all_logits(
            [SeqChunk(tokens, 0, table)]
        )
        assert rel_err(out[mode], ref) < TOL, mode
    assert rel_err(out["absorbed"], out["expanded"]) < 1e-5


def test_layer_stacks_scan_over_a_latent_pool_and_the_per_layer_loop_matches_hf(loaded):
    """scan_layers (the default): the dense prefix and the MoE layers are two stacks over one
    latent page pool, and the lowered program does not grow with depth; scan_layers off (the
    per-layer loop over per-layer caches) gives HF's logits too."""
    import jax
    import jax.numpy as jnp

    from jaxllm.models import forward, init_kv_cache, param_shapes
    from tests.model_helpers import build_step_batch

    m = loaded("q_lora")
    assert m.params["layers"] == [{}] * 3 and len(m.params["layer_stacks"]) == 2
    assert m.params["layer_stacks"][1]["moe"]["w_gate"].shape[0] == 2
    pool = init_kv_cache(m.config, 8, 4, jnp.float32)
    assert pool.latent.shape == (3 * 8, 4, 24)

    def lines(num_layers: int) -> int:
        config = replace(m.config, num_layers=num_layers)
        cache = jax.eval_shape(lambda: init_kv_cache(config, 8, 4, jnp.float32))
        batch = build_step_batch(
            [SeqChunk([5, 6, 7], 0, [2, 0])],
            tokens_per_block=4,
            num_blocks=8,
            token_bucket=8,
            max_seqs=2,
            max_blocks_per_seq=4,
        )
        lowered = jax.jit(forward, static_argnames="config").lower(param_shapes(config), cache, batch, config=config)
        return len(lowered.as_text().splitlines())

    assert lines(4) == lines(12)
    loop = replace(m.config, scan_layers=False)
    tokens = prompt(1, 13, m.config.vocab_size)
    out, _ = PagedModel(load_params(m.dir, loop), loop).all_logits(
        [SeqChunk(tokens, 0, random_block_table(np.random.default_rng(0), 32, 8))]
    )
    assert rel_err(out, hf_logits(m.hf, tokens)) < TOL


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_prefill_and_greedy_decode_match_hf_teacher_forcing(loaded, variant):
    """Auto mode: chunks run expanded, single-token steps absorbed, over one latent cache."""
    m = loaded(variant)
    runner = PagedModel(m.params, m.config)
    table = random_block_table(np.random.default_rng(1), runner.num_blocks, runner.max_blocks_per_seq)
    tokens = prompt(2, 11, m.config.vocab_size)
    _, runner.cache = runner.step([SeqChunk(tokens[:6], 0, table)])
    logits, runner.cache = runner.step([SeqChunk(tokens[6:], 6, table)])
    seq, step_logits = list(tokens), []
    for _ in range(10):
        step_logits.append(logits[0])
        seq.append(int(np.argmax(logits[0])))
        logits, runner.cache = runner.step([SeqChunk(seq[-1:], len(seq) - 1, table)])
    ref = hf_logits(m.hf, seq)
    scale = np.abs(ref).max()
    assert len(set(seq[len(tokens) :])) > 1, "greedy output is one repeated token"
    for j, pos in enumerate(range(len(tokens) - 1, len(seq) - 1)):
        chosen = seq[pos + 1]
        assert ref[pos, chosen] >= ref[pos].max() - TOL * scale, f"step {j}: token {chosen} is not HF's argmax"
        assert rel_err(step_logits[j], ref[pos]) < TOL, f"step {j}"


def test_correction_bias_changes_expert_selection_and_parity_holds(loaded):
    """The bias enters the choice only, so HF's logits move with it only through a changed
    selection; ours follow HF both with and without it."""
    m = loaded("q_lora")
    tokens = prompt(3, 13, m.config.vocab_size)
    with_bias = hf_logits(m.hf, tokens)
    params = load_params(m.dir, m.config)
    for tree in params["layer_stacks"] + params["layers"]:  # the MoE stack (scan_layers) or MoE layers
        if "moe" in tree:
            tree["moe"]["router_bias"] = tree["moe"]["router_bias"] * 0
    saved = {n: b.clone() for n, b in m.hf.named_buffers() if n.endswith("e_score_correction_bias")}
    try:
        for name, b in m.hf.named_buffers():
            if name in saved:
                b.zero_()
        without_bias = hf_logits(m.hf, tokens)
    finally:
        for name, b in m.hf.named_buffers():
            if name in saved:
                b.copy_(saved[name])
    assert rel_err(without_bias, with_bias) > 1e-2, "the correction bias did not change any expert choice"
    table = random_block_table(np.random.default_rng(2), 32, 8)
    ours_with, _ = PagedModel(m.params, m.config).all_logits([SeqChunk(tokens, 0, table)])
    ours_without, _ = PagedModel(params, m.config).all_logits([SeqChunk(tokens, 0, table)])
    assert rel_err(ours_with, with_bias) < TOL and rel_err(ours_without, without_bias) < TOL


def test_mixed_prefill_and_decode_batch_matches_separate_runs(loaded):
    m = loaded("q_lora")
    runner = PagedModel(m.params, m.config)
    rng = np.random.default_rng(4)
    table_b = random_block_table(rng, runner.num_blocks, 4)
    table_a = random_block_table(rng, runner.num_blocks, 4, exclude=table_b)
    a, b = prompt(5, 9, m.config.vocab_size), prompt(6, 6, m.config.vocab_size)
    _, cache = runner.step([SeqChunk(b[:-1], 0, table_b)])
    chunk_a, chunk_b = SeqChunk(a, 0, table_a), SeqChunk(b[-1:], len(b) - 1, table_b)
    both, _ = runner.step([chunk_a, chunk_b], cache)
    alone_a, _ = runner.step([chunk_a], cache)
    alone_b, _ = runner.step([chunk_b], cache)
    assert rel_err(both[0], alone_a[0]) < 1e-5 and rel_err(both[1], alone_b[0]) < 1e-5
    assert rel_err(both[1], hf_logits(m.hf, b)[-1]) < TOL


def test_multi_token_prediction_layers_are_skipped_with_a_log_line(loaded, tmp_path, caplog):
    from safetensors.numpy import load_file, save_file

    m = loaded("plain_q_yarn")
    directory = tmp_path / "with_mtp"
    directory.mkdir()
    (directory / "config.json").write_text((m.dir / "config.json").read_text())
    tensors = load_file(str(m.dir / "model.safetensors"))
    n, h = m.config.num_layers, m.config.hidden_size
    tensors[f"model.layers.{n}.eh_proj.weight"] = np.ones((h, 2 * h), np.float32)
    tensors[f"model.layers.{n}.enorm.weight"] = np.ones((h,), np.float32)
    save_file(tensors, str(directory / "model.safetensors"))
    with caplog.at_level(logging.INFO, logger="jaxllm.models.deepseek_weights"):
        params = load_params(directory, m.config)
    assert "skipping 2 multi-token-prediction tensors (layers 3)" in caplog.text
    assert len(params["layers"]) == n
    tensors["model.layers.0.self_attn.stray.weight"] = np.ones((2,), np.float32)
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensors.*stray"):
        load_params(directory, m.config)


def test_router_correction_bias_stays_float32_in_a_bfloat16_model(loaded):
    import jax
    import jax.numpy as jnp

    from jaxllm.engine.load_balancer import moe_layer_params
    from jaxllm.models import param_shapes

    m = loaded("q_lora")
    params = load_params(m.dir, m.config, dtype="bfloat16")
    bias = moe_layer_params(params, 1)["router_bias"]  # the MoE layers' stack [n, E]
    assert bias.dtype == jnp.float32 and params["layer_stacks"][1]["attn"]["kv_a"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(bias), np.asarray(moe_layer_params(m.params, 1)["router_bias"]))
    shapes = param_shapes(m.config, "bfloat16")
    assert jax.tree_util.tree_map(lambda a: a.dtype, params) == jax.tree_util.tree_map(lambda a: a.dtype, shapes)


# DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3, without its fp8 quantization_config).
DEEPSEEK_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_nextn_predict_layers=1,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    ep_size=1,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    topk_method="noaux_tc",
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    moe_layer_freq=1,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    scoring_func="sigmoid",
    hidden_act="silu",
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    rope_theta=10000,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    attention_bias=False,
    bos_token_id=0,
    eos_token_id=1,
    rope_scaling={
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
)


def test_latent_cache_bytes_per_token_for_deepseek_v3():
    """The module docstring's figures: 70,272 B per token vs 4,997,120 B for full K/V (71.1x)."""
    config = ModelConfig.from_hf_config(DEEPSEEK_V3)
    assert config.is_mla and config.dtype == "bfloat16" and config.rope_scaling.factor == 40
    latent = kv_cache_bytes_per_token(config, "bfloat16")
    assert latent == MlaKvCacheSpec(61, 512, 64, "bfloat16").bytes_per_token() == 61 * 576 * 2 == 70272
    # Full K/V for the same attention: K 192 (nope + rope) and V 128 wide per head, i.e. 2 x 160 on average.
    full = MhaKvCacheSpec(61, 128, (192 + 128) // 2, "bfloat16").bytes_per_token()
    assert full == 61 * 128 * (192 + 128) * 2 == 4997120
    assert round(full / latent, 1) == 71.1


def test_grouped_routing_keeps_experts_within_the_best_groups():
    import jax.numpy as jnp

    from jaxllm.models.moe import route_grouped_sigmoid

    config = ModelConfig.from_hf_config(DEEPSEEK_V3)
    logits = np.random.default_rng(0).normal(size=(64, 256)).astype(np.float32)
    bias = np.random.default_rng(1).normal(scale=0.1, size=256).astype(np.float32)
    weights, ids = (np.asarray(a) for a in route_grouped_sigmoid(jnp.asarray(logits), jnp.asarray(bias), config))
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    choice = (scores + bias).reshape(64, 8, 32)
    group_scores = np.sort(choice, axis=-1)[..., -2:].sum(-1)
    for t in range(64):
        best = set(np.argsort(-group_scores[t])[:4])
        assert {int(e) // 32 for e in ids[t]} <= best
        allowed = np.concatenate([np.arange(g * 32, g * 32 + 32) for g in sorted(best)])
        top = allowed[np.argsort(-(scores[t] + bias)[allowed])[:8]]
        assert set(ids[t].tolist()) == set(top.tolist())
        expected = scores[t, ids[t]] / scores[t, ids[t]].sum() * 2.5
        np.testing.assert_allclose(weights[t], expected, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# The engine


def _engine_outputs(engine, prompts_by_step: dict[int, list[list[int]]], max_tokens: int) -> dict[int, list[int]]:
    from jaxllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    outputs: dict[int, list[int]] = {}
    step = 0
    while step in prompts_by_step or engine.has_unfinished_requests() or step < max(prompts_by_step):
        for p in prompts_by_step.get(step, []):
            engine.add_request(p, params)
        for update in engine.step():
            outputs.setdefault(update.request.request_id, []).extend(update.new_token_ids)
        step += 1
    return outputs


def staggered_prompts(vocab: int, seed: int = 11) -> dict[int, list[list[int]]]:
    """Long prompts (chunked at 32 tokens) and two sharing a 24-token prefix that the cache holds."""
    rng = np.random.default_rng(seed)

    def p(n: int) -> list[int]:
        return [int(t) for t in rng.integers(3, vocab, n)]

    shared = p(24)
    return {0: [p(45), p(5)], 2: [shared + p(9)], 6: [shared + p(14), p(20)]}


def test_engine_in_flight_batching_matches_one_request_at_a_time_and_hf(tmp_path):
    from tests.parallel_workload import small_engine

    hf = write_checkpoint(tmp_path / "ds", ENGINE, seed=3, tokenizer=True)
    engine = small_engine(tmp_path / "ds", tmp_path / "ds")
    arrivals = staggered_prompts(ENGINE["vocab_size"])
    batched = _engine_outputs(engine, arrivals, max_tokens=7)
    stats = engine.iteration_stats
    assert any(
        s["inflightBatchingStats"]["numContextRequests"] and s["inflightBatchingStats"]["numGenRequests"] for s in stats
    ), "no step mixed prefill and decode"
    assert engine.kv_cache_manager.get_kv_cache_stats().reused_blocks > 0
    prompts = [p for step in sorted(arrivals) for p in arrivals[step]]
    alone = {}
    for p in prompts:
        alone.update(_engine_outputs(engine, {0: [p]}, max_tokens=7))
    ids = sorted(batched)
    assert [batched[i] for i in ids] == [alone[i] for i in sorted(alone)]
    for p, i in zip(prompts, ids):
        ref = hf_logits(hf, p + batched[i])
        scale = np.abs(ref).max()
        for j, token in enumerate(batched[i]):
            row = ref[len(p) - 1 + j]
            assert row[token] >= row.max() - TOL * scale, f"request {i} token {j}"


# ---------------------------------------------------------------------------------------------
# The latent variant of the ragged paged attention kernel


def _latent_case(
    seed: int,
    q_lens: list[int],
    kv_lens: list[int],
    *,
    heads: int,
    dim: int,
    tpb: int,
    num_blocks: int,
    max_blocks: int,
    num_tokens: int,
    num_seq_slots: int,
):
    rng = np.random.default_rng(seed)
    tables = np.zeros((num_seq_slots, max_blocks), np.int32)
    free = rng.permutation(num_blocks)
    used = 0
    for s, kv in enumerate(kv_lens):
        n = -(-kv // tpb)
        tables[s, :n] = free[used : used + n]
        used += n
    cu = np.zeros(num_seq_slots + 1, np.int32)
    cu[1 : len(q_lens) + 1] = np.cumsum(q_lens)
    cu[len(q_lens) + 1 :] = cu[len(q_lens)]
    lens = np.zeros(num_seq_slots, np.int32)
    lens[: len(kv_lens)] = kv_lens
    q = rng.standard_normal((num_tokens, heads, dim), dtype=np.float32)
    latent = rng.standard_normal((num_blocks, tpb, dim), dtype=np.float32)
    return q, latent, lens, tables, cu, np.array([len(q_lens)], np.int32)


@pytest.mark.parametrize("splits", [1, 2])
def test_latent_attention_kernel_matches_reference_in_interpret_mode(splits):
    """A mixed batch (a chunk over cached context, a fresh prefill, decodes), 4 heads sharing
    one latent of width 24 (not a power of two) whose first 16 columns are the values."""
    from pallas_kernels.ragged_paged_attention import (
        AttentionTiling,
        ragged_paged_latent_attention,
        ragged_paged_latent_attention_reference,
    )

    args = _latent_case(
        0,
        [9, 13, 1, 1],
        [30, 13, 7, 22],
        heads=4,
        dim=24,
        tpb=4,
        num_blocks=40,
        max_blocks=10,
        num_tokens=32,
        num_seq_slots=6,
    )
    total = 24
    ref = np.asarray(ragged_paged_latent_attention_reference(*args, sm_scale=0.2, value_dim=16))
    out = ragged_paged_latent_attention(
        *args, sm_scale=0.2, value_dim=16, interpret=True, tiling=AttentionTiling(16, 16, splits, 4, 2)
    )
    assert out.shape == (32, 4, 16)
    assert rel_err(np.asarray(out)[:total], ref[:total]) < 1e-5
    assert not np.asarray(out)[total:].any()


@pytest.mark.parametrize("splits", [1, 2])
def test_latent_attention_kernel_with_head_blocks_matches_reference(splits):
    """32 heads over one latent with 16-row tiles: each token's heads are cut into two head
    blocks, one program each (the layout DeepSeek-V3's 128 heads x 576 columns need on a GPU)."""
    from pallas_kernels.ragged_paged_attention import (
        AttentionTiling,
        ragged_paged_latent_attention,
        ragged_paged_latent_attention_reference,
    )

    args = _latent_case(
        1, [5, 1, 1], [12, 7, 22], heads=32, dim=24, tpb=4, num_blocks=24, max_blocks=6, num_tokens=8, num_seq_slots=4
    )
    total = 7
    ref = np.asarray(ragged_paged_latent_attention_reference(*args, sm_scale=0.2, value_dim=16))
    out = ragged_paged_latent_attention(
        *args, sm_scale=0.2, value_dim=16, interpret=True, tiling=AttentionTiling(16, 16, splits, 4, 2)
    )
    assert rel_err(np.asarray(out)[:total], ref[:total]) < 1e-5
    assert not np.asarray(out)[total:].any()


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("num_tokens,num_seq_slots", [(64, 64), (512, 64), (1, 1)], ids=["decode", "mixed", "one"])
def test_latent_attention_tiles_fit_hopper_shared_memory(num_tokens, num_seq_slots, heads):
    """Every launch at DeepSeek-V3's latent shape asks for at most Hopper's 227 KiB of shared
    memory per program (the estimate matched the Triton lowering's request on an H200)."""
    from pallas_kernels.ragged_paged_attention.kernel import plan_launches
    from pallas_kernels.ragged_paged_attention.tiling import shared_memory_bytes

    for launch in plan_launches(num_tokens, num_seq_slots, heads, 1, 576, 4096, 2):
        assert shared_memory_bytes(launch.tiling, 576, 512) <= 227 * 1024, launch.tiling


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("num_tokens,num_seq_slots", [(64, 64), (512, 64)], ids=["decode", "mixed"])
def test_latent_attention_kernel_lowers_for_cuda_at_deepseek_v3_shapes(num_tokens, num_seq_slots, heads):
    """One device (128 heads) and 8-way tensor parallelism (16 of the 128 heads), latent 512 + 64, bf16."""
    import functools

    import jax
    import jax.numpy as jnp

    from pallas_kernels.ragged_paged_attention import ragged_paged_latent_attention

    s = jax.ShapeDtypeStruct
    specs = (
        s((num_tokens, heads, 576), jnp.bfloat16),
        s((4096, 32, 576), jnp.bfloat16),
        s((num_seq_slots,), jnp.int32),
        s((num_seq_slots, 128), jnp.int32),
        s((num_seq_slots + 1,), jnp.int32),
        s((1,), jnp.int32),
    )
    fn = functools.partial(ragged_paged_latent_attention, sm_scale=192**-0.5, value_dim=512)
    with verified_triton_lowering():
        text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text or "triton_kernel_call" in text, "no Triton kernel in the lowering"


def test_pallas_backend_pairs_the_latent_kernel_with_the_mha_one():
    """The engine's Pallas attention backend hands MLA the latent kernel (interpret mode here),
    which agrees with the reference backend's latent attention on the cache pytree."""
    from jaxllm.kv_cache.spec import MlaLayerCache
    from jaxllm.models.attention import (
        AttentionMetadata,
        latent_attention_of,
        reference_attention,
    )
    from jaxllm.models.backends import resolve_backends

    q, latent, kv_lens, tables, cu, num_seqs = _latent_case(
        1, [6, 1, 1], [11, 9, 3], heads=4, dim=24, tpb=4, num_blocks=16, max_blocks=4, num_tokens=16, num_seq_slots=4
    )
    md = AttentionMetadata(np.zeros(16, np.int32), kv_lens, tables, cu, num_seqs)
    _, _, pallas_fn, _ = resolve_backends("pallas", "xla")
    assert pallas_fn.latent.__name__ == "pallas_latent_attention"
    ours = latent_attention_of(pallas_fn)(q, MlaLayerCache(latent), md, sm_scale=0.3, value_dim=16)
    ref = latent_attention_of(reference_attention())(q, MlaLayerCache(latent), md, sm_scale=0.3, value_dim=16)
    assert rel_err(np.asarray(ours)[:8], np.asarray(ref)[:8]) < 1e-5
