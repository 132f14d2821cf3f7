"""Attention data parallelism on 8 fake CPU devices (one subprocess, see tests/multidevice.py).

- Layer level (one small compile per layout): the attention-DP MoE layer
  (`jaxllm.models.parallel.attention_dp.dp_moe_layer`, tokens already split over the N devices, padding
  rows on every rank) for every (N, E, T) with N in {2, 4, 8}, each dispatch mode (the
  ragged_all_to_all one through `emulated_ragged_all_to_all`), with a
  placement holding redundant slots, against the plain single-device MoE layer on the same
  tokens: outputs within 1e-5 (float32) and the global expert counts equal.
- The ragged_all_to_all dispatch: its logic checked above with the collective emulated (XLA:CPU
  lacks it), the real collective lowered for CUDA from this CPU-only process (plain EP layer and
  attention-DP layer), the engine refusing the mode on CPU.
- Engine level (Qwen3-MoE and Mixtral tiny checkpoints, the staggered in-flight-batching
  workload of tests/parallel_workload.py: chunked prefill, prefix reuse, prefill and decode
  in one step, overlap scheduler; prefix reuse only within a rank, so the shared prompts,
  placed on different ranks, reuse nothing): engines with `enable_attention_dp=True` give exactly the
  single-device engine's greedy tokens, and the logits each token was sampled from agree
  within 1e-5; requests are spread over the ranks.
The same layouts without attention DP are checked by test_ep_moe.py and test_engine_ep.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.multidevice import run_on_cpu_devices
from tests.parallel_workload import run_staggered_requests, small_engine

LAYOUTS = [(n, e, n // e) for n in (2, 4, 8) for e in (1, 2, 4, 8) if n % e == 0]
MODES = ("all_to_all", "allgather", "ragged_all_to_all")  # ragged: emulated on CPU
# (arch, N, E, dispatch, redundant placement?)
ENGINE_CASES = [
    ("qwen3_moe", 8, 8, "allgather", True),
    ("mixtral", 4, 2, "all_to_all", False),
]


def capture_logits(engine) -> dict:
    """From now on, the logits row each sampled token came from, keyed (request id, output index)."""
    captured: dict = {}
    last: dict = {}
    by_step: dict = {}  # id of a step's sampled tokens -> the logits its forward produced
    run_forward, execute, process = engine.runner.run_forward, engine.runner.execute, engine.readback.process

    def record_forward(*args, **kwargs):
        out = run_forward(*args, **kwargs)
        last["logits"] = np.asarray(out[0])  # what the sampler (or the greedy argmax) reads
        return out

    def record_execute(*args, **kwargs):
        result = execute(*args, **kwargs)
        by_step[id(result.sampled.token_ids)] = last["logits"]
        return result

    def record_process(pending):
        logits = by_step.pop(id(pending.sampler_output.token_ids), None)
        for request, row, index in pending.entries if logits is not None else ():
            captured[(request.request_id, index)] = logits[row]
        return process(pending)

    engine.runner.run_forward = record_forward
    engine.runner.execute = record_execute
    engine.readback.process = record_process
    return captured


def run_engine(directory: Path, tokenizer: Path, **engine_args) -> tuple[dict, dict, object]:
    engine = small_engine(directory, tokenizer, **engine_args)
    logits = capture_logits(engine)
    tokens = run_staggered_requests(engine)
    return tokens, logits, engine


# ---------------------------------------------------------------------------------------------
# Subprocess side (8 devices)


def check_layers() -> None:
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jaxllm.models import ModelConfig
    from jaxllm.models.ep_moe import EpMoeOptions
    from jaxllm.models.moe import moe_block
    from jaxllm.models.parallel.attention_dp import dp_moe_layer
    from jaxllm.models.partitioning import attention_dp_rules
    from pallas_kernels.moe_grouped_gemm.tiled_xla import moe_grouped_ffn_tiled
    from sharding import ParallelConfig, make_mesh
    from sharding.dp_ranks import RANK_SPEC
    from sharding.rules import named_sharding
    from sharding.slot_table import make_slot_table
    from tests.test_ep_moe import hf_config, redundant_placement

    config = ModelConfig.from_hf_config(hf_config("qwen3_moe"))
    rng = np.random.default_rng(3)
    E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
    experts = {
        name: rng.standard_normal(shape).astype(np.float32) * 0.3
        for name, shape in (("w_gate", (E, H, I)), ("w_up", (E, H, I)), ("w_down", (E, I, H)))
    }
    router = rng.standard_normal((H, E)).astype(np.float32)
    tokens_per_rank = 6
    # One single-device reference over the tokens of 8 ranks (the layer is per token, so each
    # layout compares against the rows of its first N ranks).
    x_all = rng.standard_normal((8, tokens_per_rank, H)).astype(np.float32)
    # Rank r has tokens_per_rank - (r % 3) live tokens, the rest padding.
    valid_all = np.arange(tokens_per_rank)[None, :] < (tokens_per_rank - np.arange(8) % 3)[:, None]
    want_all, ids_all = jax.jit(functools.partial(moe_block, config=config, moe_fn=moe_grouped_ffn_tiled))(
        jnp.asarray(x_all.reshape(-1, H)), jax.tree.map(jnp.asarray, dict(router=router, **experts))
    )
    want_all = np.asarray(want_all).reshape(8, tokens_per_rank, H)
    ids_all = np.asarray(ids_all).reshape(8, tokens_per_rank, -1)
    for n, e, t in LAYOUTS:
        mesh = make_mesh(ParallelConfig(tensor_parallel_size=n, moe_expert_parallel_size=e))
        rules = attention_dp_rules(config, mesh)
        x, valid = x_all[:n], valid_all[:n]
        want = want_all[:n][valid]
        want_counts = np.bincount(ids_all[:n][valid].reshape(-1), minlength=E)
        # A placement with redundant slots (replicas on different ranks); both dispatch modes in
        # one program per layout (the default placement is covered by the engine cases).
        slots = redundant_placement(E, e)
        p = {
            name: jax.device_put(
                w[np.asarray(slots)],
                named_sharding(
                    mesh,
                    ("experts", "embed", "moe_mlp") if name != "w_down" else ("experts", "moe_mlp", "embed"),
                    rules,
                ),
            )
            for name, w in experts.items()
        }
        p["router"] = router
        p["slots"] = make_slot_table(slots, E)
        layers = [
            functools.partial(
                dp_moe_layer,
                config=config,
                moe_fn=moe_grouped_ffn_tiled,
                options=EpMoeOptions(dispatch=mode, ragged_emulation=True),
                ep=e,
                moe_tp=t,
                global_tokens=n * tokens_per_rank,
            )
            for mode in MODES
        ]

        def body(x_, valid_, p_):
            outs = [layer(x_[0], p_, valid_[0]) for layer in layers]
            return tuple((y[None], counts, dropped[None]) for y, counts, dropped in outs)

        in_p = dict(
            {name: p[name].sharding.spec for name in ("w_gate", "w_up", "w_down")},
            router=P(),
            slots=jax.tree.map(lambda _: P(), p["slots"]),
        )
        results = jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(RANK_SPEC, RANK_SPEC, in_p),
                out_specs=tuple((RANK_SPEC, P(), P()) for _ in MODES),
                check_vma=False,
            )
        )(x, valid, p)
        for mode, (y, counts, dropped) in zip(MODES, results):
            err = float(np.abs(np.asarray(y)[valid] - np.asarray(want)).max())
            print(
                json.dumps(
                    dict(
                        kind="layer",
                        n=n,
                        e=e,
                        t=t,
                        mode=mode,
                        slots=len(slots),
                        err=err,
                        counts_ok=np.asarray(counts).tolist() == want_counts.tolist(),
                        dropped=int(np.asarray(dropped).max()),
                    )
                ),
                flush=True,
            )


def check_ragged_lowers_for_cuda() -> None:
    """The real ragged_all_to_all dispatch (plain EP layer and attention-DP layer) lowers for CUDA
    from this CPU-only process; running it here fails (XLA:CPU does not implement it)."""
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jaxllm.models import ModelConfig
    from jaxllm.models.ep_moe import EpMoeOptions, ep_moe_block
    from jaxllm.models.parallel.attention_dp import dp_moe_layer
    from jaxllm.models.partitioning import attention_dp_rules
    from pallas_kernels.moe_grouped_gemm.reference import moe_grouped_ffn_reference
    from sharding import ParallelConfig, make_mesh
    from sharding.dp_ranks import RANK_SPEC
    from sharding.rules import named_sharding
    from sharding.slot_table import default_assignment, make_slot_table
    from tests.test_ep_moe import hf_config

    config = ModelConfig.from_hf_config(hf_config("qwen3_moe"))
    E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
    mesh = make_mesh(ParallelConfig(tensor_parallel_size=8, moe_expert_parallel_size=4))
    rules = attention_dp_rules(config, mesh)
    slots = np.asarray(default_assignment(E, E, 4))
    p = {
        name: jax.device_put(jnp.zeros(shape, jnp.float32), named_sharding(mesh, axes, rules))
        for name, shape, axes in (
            ("w_gate", (E, H, I), ("experts", "embed", "moe_mlp")),
            ("w_up", (E, H, I), ("experts", "embed", "moe_mlp")),
            ("w_down", (E, I, H), ("experts", "moe_mlp", "embed")),
        )
    }
    p["router"] = jnp.zeros((H, E), jnp.float32)
    p["slots"] = make_slot_table(slots, E)
    options = EpMoeOptions(dispatch="ragged_all_to_all")
    x = jnp.zeros((16, H), jnp.float32)
    plain = jax.jit(
        functools.partial(
            ep_moe_block, config=config, moe_fn=moe_grouped_ffn_reference, mesh=mesh, rules=rules, options=options
        )
    )
    layer = functools.partial(
        dp_moe_layer, config=config, moe_fn=moe_grouped_ffn_reference, options=options, ep=4, moe_tp=2, global_tokens=16
    )
    in_p = dict(
        {name: p[name].sharding.spec for name in ("w_gate", "w_up", "w_down")},
        router=P(),
        slots=jax.tree.map(lambda _: P(), p["slots"]),
    )
    dp = jax.jit(
        jax.shard_map(
            lambda x_, v_, p_: layer(x_[0], p_, v_[0])[0][None],
            mesh=mesh,
            in_specs=(RANK_SPEC, RANK_SPEC, in_p),
            out_specs=RANK_SPEC,
            check_vma=False,
        )
    )
    dp_args = (jnp.zeros((8, 2, H), jnp.float32), jnp.ones((8, 2), bool), p)
    texts = [
        plain.trace(x, p).lower(lowering_platforms=("cuda",)).as_text(),
        dp.trace(*dp_args).lower(lowering_platforms=("cuda",)).as_text(),
    ]
    try:
        plain(x, p)
        cpu_error = ""
    except Exception as exc:  # noqa: BLE001 - the message is the result
        cpu_error = str(exc)
    print(
        json.dumps(
            dict(kind="ragged_lowering", cuda_ok=["ragged_all_to_all" in t for t in texts], cpu_error=cpu_error[:300])
        ),
        flush=True,
    )


def check_engines(root: Path) -> None:
    from jaxllm.engine.ranked_planner import RankAssignment
    from jaxllm.llm_args import KvCacheConfig, MoeConfig
    from jaxllm.models import materialize_preset
    from sharding.eplb.eplb_config import MoeLoadBalancerConfig
    from tests.test_ep_moe import redundant_placement, write_checkpoint

    tokenizer = materialize_preset("tiny-moe")
    placed: list[int] = []
    place = RankAssignment.place

    def record_place(self, request):
        known = request.request_id in self.rank_of
        rank = place(self, request)
        if not known:
            placed.append(rank)
        return rank

    RankAssignment.place = record_place
    for arch in ("qwen3_moe", "mixtral"):
        directory = write_checkpoint(arch, root / arch, seed=5, vocab_size=256)
        base_tokens, base_logits, base = run_engine(directory, tokenizer)
        moe_layers = [i for i in range(base.model_config.num_layers) if base.model_config.is_moe_layer(i)]
        num_experts = base.model_config.num_experts
        for case_arch, n, e, mode, redundant in ENGINE_CASES:
            if case_arch != arch:
                continue
            balancer = None
            if redundant:
                slots = redundant_placement(num_experts, e, seed=n)
                balancer = MoeLoadBalancerConfig(
                    num_slots=len(slots), initial_global_assignments={layer: slots for layer in moe_layers}
                )
            placed.clear()
            tokens, logits, engine = run_engine(
                directory,
                tokenizer,
                tensor_parallel_size=n,
                moe_expert_parallel_size=e,
                enable_attention_dp=True,
                moe_config=MoeConfig(load_balancer=balancer, dispatch=mode),
                kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=512, event_buffer_max_size=10_000),
            )
            err = max(float(np.abs(logits[k] - base_logits[k]).max()) for k in base_logits)
            mixed = any(
                s["inflightBatchingStats"]["numContextRequests"] and s["inflightBatchingStats"]["numGenRequests"]
                for s in engine.iteration_stats
            )
            print(
                json.dumps(
                    dict(
                        kind="engine",
                        arch=arch,
                        n=n,
                        e=e,
                        mode=mode,
                        redundant=redundant,
                        same_tokens=tokens == base_tokens,
                        num_tokens=sum(map(len, tokens.values())),
                        same_keys=sorted(logits) == sorted(base_logits),
                        err=err,
                        ranks=placed,
                        mixed=mixed,
                        kv_shape=list(engine.runner.kv_cache[0].k.shape),
                        events_match=kv_events_match_pools(engine),
                    )
                ),
                flush=True,
            )


def kv_events_match_pools(engine) -> bool:
    """Each rank's KV cache events, replayed, give exactly that rank's cached blocks."""
    from tests.kv_event_replay import replay as _replay

    events = engine.get_kv_cache_events()
    ok = [e["data"] for e in events if e["data"]["type"] == "created"] == [
        {"type": "created", "num_blocks_per_cache_level": [m.num_blocks]} for m in engine.kv_cache_manager.managers
    ]
    cached = 0
    for rank, manager in enumerate(engine.kv_cache_manager.managers):
        live: dict = {}
        _replay([e for e in events if e["attention_dp_rank"] == rank and e["data"]["type"] != "created"], live)
        ok = ok and live == manager.block_pool.cached_prefixes()
        cached += len(live)
    return ok and cached > 0


def check_all(root: Path) -> None:
    import jax

    assert len(jax.devices()) == 8
    check_layers()
    check_ragged_lowers_for_cuda()
    check_engines(root)


@pytest.fixture(scope="module")
def dp_results(tmp_path_factory):
    return run_on_cpu_devices("test_attention_dp", "check_all", tmp_path_factory.mktemp("attention_dp"))


def test_dp_moe_layer_matches_single_device_for_every_layout(dp_results):
    layers = [r for r in dp_results if r["kind"] == "layer"]
    assert len(layers) == len(LAYOUTS) * len(MODES)
    for r in layers:
        case = f"N{r['n']} E{r['e']} T{r['t']} {r['mode']} slots={r['slots']}"
        assert r["slots"] > 8, "a placement with redundant slots"
        assert r["err"] < 1e-5, f"{case}: error {r['err']}"
        assert r["counts_ok"], f"{case}: expert counts differ from the single-device count"
        assert r["dropped"] == 0, case


def test_ragged_all_to_all_lowers_for_cuda_and_is_refused_on_cpu(dp_results):
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine
    from jaxllm.llm_args import MoeConfig

    (r,) = [r for r in dp_results if r["kind"] == "ragged_lowering"]
    assert r["cuda_ok"] == [True, True], "the ragged_all_to_all dispatch does not lower for CUDA"
    assert "ragged-all-to-all" in r["cpu_error"] or "ragged_all_to_all" in r["cpu_error"], r["cpu_error"]
    with pytest.raises(ValueError, match="ragged_all_to_all.*XLA:CPU"):
        LLMEngine(EngineConfig(model="tiny-moe", moe_config=MoeConfig(dispatch="ragged_all_to_all")))


def test_attention_dp_engine_matches_single_device(dp_results):
    engines = [r for r in dp_results if r["kind"] == "engine"]
    assert len(engines) == len(ENGINE_CASES)
    for r in engines:
        case = f"{r['arch']} N{r['n']} E{r['e']} {r['mode']} redundant={r['redundant']}"
        assert r["same_tokens"] and r["num_tokens"] == 35, f"{case}: greedy tokens differ from one device"
        assert r["same_keys"], case
        assert r["err"] < 1e-5, f"{case}: logits differ by {r['err']}"
        assert r["kv_shape"][0] == r["n"], f"{case}: one KV block pool per rank"
        assert sorted(r["ranks"]) == sorted(i % r["n"] for i in range(5)), f"{case}: placement {r['ranks']}"
        assert r["mixed"], case
        assert r["events_match"], f"{case}: per-rank KV cache events differ from the ranks' block pools"


def test_rank_assignment_balances_and_planner_numbers_rows_rank_major():
    from jaxllm import SamplingParams
    from jaxllm.engine.planner import Planner
    from jaxllm.engine.ranked_planner import (
        AttentionDpPlanner,
        RankAssignment,
        RankedKvCaches,
    )
    from jaxllm.kv_cache import KVCacheManager
    from jaxllm.llm_args import SchedulerConfig
    from jaxllm.llm_request import LlmRequest
    from jaxllm.scheduler import make_scheduler

    assignment = RankAssignment(2)
    planners = []
    for _ in range(2):
        kv = KVCacheManager(16, 4, 8, max_num_sequences=2)
        planners.append(
            Planner(
                scheduler=make_scheduler(SchedulerConfig(), kv, 2, 16, True),
                kv_cache_manager=kv,
                max_batch_size=2,
                max_num_tokens=16,
                min_token_bucket=8,
                max_blocks_per_seq=8,
                max_seq_len=32,
            )
        )
    planner = AttentionDpPlanner(planners, assignment)
    kv = RankedKvCaches([p.kv_cache_manager for p in planners], assignment)
    requests = [
        LlmRequest(
            request_id=i,
            prompt_token_ids=list(range(3, 3 + n)),
            max_new_tokens=4,
            sampling_params=SamplingParams(max_tokens=4),
        )
        for i, n in enumerate((10, 3, 5))
    ]
    output = planner.schedule(requests)
    assert [assignment.rank_of[r.request_id] for r in requests] == [0, 1, 1]  # fewest requests, then tokens
    plan = planner.build(output)
    assert plan.batch.token_ids.shape == (2, 16) and plan.feed_index.shape == (2, 16)
    assert plan.batch.num_seqs[:, 0].tolist() == [1, 2]
    assert plan.num_tokens == 18
    entries = planner.commit(output)
    assert sorted((r.request_id, row) for r, row, _ in entries) == [(0, 0), (1, 2), (2, 3)]
    assert plan.sampling.temperature.shape[0] == 4
    assert kv.has_sequence(requests[2]) and kv.get_kv_cache_stats().used_num_blocks == 3 + 1 + 2
    kv.free_resources(requests[1])
    assert not kv.has_sequence(requests[1]) and assignment.num_placed(1) == 1
