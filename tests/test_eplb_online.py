"""The online expert load balancer on 8 fake CPU devices (one subprocess; see tests/multidevice.py).

1. Engine, EP 8, 16 slots over 8 experts, two MoE layers, one layer rebalanced per step, every
   differing placement applied (negative gain threshold) and no move-minimizing mapping, so
   slots move all the time: a long in-flight-batching run (chunked prefill, prefill and decode
   in one step) gives exactly the greedy tokens of the same engine with the balancer off;
   nothing compiles after warm-up (every backend compile is counted); iteration stats carry
   the per-layer imbalance and the rebalance count; statistics recorded while it runs go
   through `jaxllm eplb report`.
2. Every round that rewrites slots leaves the device memory as it was: the same live bytes,
   the slot buffers donated (the old arrays deleted) and still at the same device addresses.
3. The skewed-routing benchmark's workload (real EP MoE layers, Zipf router bias) with the hot
   set switched halfway: the measured imbalance comes back under 0.10 within a bounded number
   of steps while the static placement stays far above it.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from tests.balancer_engines import RoundWatch, moving_balancer, staggered_workload
from tests.multidevice import run_on_cpu_devices

NUM_SLOTS = 16
RECOVERY_BOUND = 40  # steps after the switch (the benchmark's moving average of 10 steps included)


def _workload(engine) -> dict[int, list[int]]:
    """Requests arriving over 24 steps, prompts of 4-40 tokens (chunked at 16), 24 tokens each."""
    return staggered_workload(engine, seed=3, last_arrival=24, max_tokens=24)


def _device_memory() -> int:
    import jax

    stats = [d.memory_stats() for d in jax.devices()]
    if all(s and "bytes_in_use" in s for s in stats):
        return sum(s["bytes_in_use"] for s in stats)
    # CPU keeps no allocator statistics: sum the distinct device buffers behind the live arrays
    # (a sharded array and the per-device views of its shards share buffers).
    buffers = {}
    for array in jax.live_arrays():
        if not array.is_deleted():
            for shard in array.addressable_shards:
                buffers[(shard.device.id, shard.data.unsafe_buffer_pointer())] = shard.data.nbytes
    return sum(buffers.values())


def check_engine(root: Path) -> None:
    import io
    from contextlib import redirect_stdout

    import jax
    import jax.monitoring

    from jaxllm import KvCacheConfig
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine
    from jaxllm.llm_args import MoeConfig
    from jaxllm.models import materialize_preset
    from sharding.eplb.cli import report_main
    from sharding.eplb.statistics import load_expert_statistics
    from tests.test_ep_moe import write_checkpoint

    directory = write_checkpoint("qwen3_moe", root / "qwen3_moe", seed=5, vocab_size=256, num_hidden_layers=3)
    stats_dir = root / "stats"
    os.environ["EXPERT_STATISTIC_ITER_RANGE"] = "2-30"
    os.environ["EXPERT_STATISTIC_PATH"] = str(stats_dir)
    engine = LLMEngine(
        EngineConfig(
            model=str(directory),
            tokenizer=str(materialize_preset("tiny-moe")),
            dtype="float32",
            max_batch_size=6,
            max_num_tokens=16,
            max_seq_len=96,
            tensor_parallel_size=8,
            moe_expert_parallel_size=8,
            kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=768, enable_block_reuse=False),
            moe_config=MoeConfig(load_balancer=moving_balancer(NUM_SLOTS), dispatch="all_to_all"),
        )
    )
    engine.warmup(all_variants=False)
    compiles: list[str] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if event.endswith("backend_compile_duration") else None
    )
    balancer = engine.load_balancer
    # The two MoE layers are one layer stack (scanned); the balancer writes rows of its buffers.
    stacked = engine.runner.params["layers"][1:] == [{}, {}] and balancer.rows == {1: 0, 2: 1}
    watch = RoundWatch(balancer, device_memory=_device_memory)
    on = _workload(engine)
    balancer.worker.wait_idle()
    engine.close_statistics()
    steps_on = len(engine.iteration_stats)
    lb_stats = [s["moeLoadBalancerStats"] for s in engine.iteration_stats]
    engine.load_balancer = None  # the same compiled engine, placement now static
    off = _workload(engine)
    engine.load_balancer = balancer
    engine.close()
    del os.environ["EXPERT_STATISTIC_ITER_RANGE"], os.environ["EXPERT_STATISTIC_PATH"]
    report = io.StringIO()
    with redirect_stdout(report):
        report_main(["--expert_statistic_path", str(stats_dir), "--ep_size", "8"])
    recorded = load_expert_statistics(stats_dir)
    top_k = engine.model_config.num_experts_per_tok
    tokens = [
        s["inflightBatchingStats"]["numCtxTokens"] + s["inflightBatchingStats"]["numGenRequests"]
        for s in engine.iteration_stats[:steps_on]
    ]
    print(
        json.dumps(
            dict(
                kind="engine",
                stacked=stacked,
                on={str(k): v for k, v in on.items()},
                off={str(k): v for k, v in off.items()},
                steps=steps_on,
                compiles_after_warmup=len(compiles),
                rebalances=balancer.stats.rebalances,
                slots_rewritten=balancer.stats.slots_rewritten,
                worker_error=repr(balancer.worker.error),
                mixed=any(
                    s["inflightBatchingStats"]["numContextRequests"] and s["inflightBatchingStats"]["numGenRequests"]
                    for s in engine.iteration_stats[:steps_on]
                ),
                lb_stats=lb_stats,
                rounds=watch.rounds,
                report=report.getvalue(),
                recorded_width=recorded.num_experts,
                recorded_iters=recorded.iters,
                recorded_sums_ok=all(
                    int(recorded.counts[i, l].sum()) == top_k * tokens[it]
                    for i, it in enumerate(recorded.iters)
                    for l in range(len(recorded.layers))
                ),
                worker_alive=balancer.worker.alive,
            )
        ),
        flush=True,
    )


def check_skew_change(root: Path) -> None:
    from jaxllm.bench.eplb_online import build_parser, run_online, summarize

    args = build_parser().parse_args(
        [
            "--layers",
            "2",
            "--experts",
            "32",
            "--num-slots",
            "40",
            "--tokens",
            "256",
            "--steps",
            "100",
            "--sync-worker",
            "--seed",
            "1",
        ]
    )
    run = run_online(args, minimize_moves=True)
    print(json.dumps(dict(kind="skew", **summarize(run, args), imbalance=run.imbalance)), flush=True)


def check_program_size() -> None:
    """Lowered lines of the TP 8 x EP 8 forward (experts as slots) at two depths, scanned and unrolled."""
    import jax

    from jaxllm.bench.compile_time import _sharded_params, model_config
    from jaxllm.models import forward, init_kv_cache
    from sharding.mesh import ParallelConfig, make_mesh
    from tests.model_helpers import SeqChunk, build_step_batch

    mesh = make_mesh(ParallelConfig(tensor_parallel_size=8, moe_expert_parallel_size=8))
    batch = build_step_batch(
        [SeqChunk([5, 6, 7], 0, [2, 0])],
        tokens_per_block=4,
        num_blocks=8,
        token_bucket=8,
        max_seqs=2,
        max_blocks_per_seq=4,
    )
    lines = {}
    for scan in (True, False):
        for layers in (3, 5):
            config = model_config("qwen3_moe", layers, 64, scan, heads=8)
            lowered = jax.jit(functools.partial(forward, config=config, mesh=mesh)).lower(
                _sharded_params(config, mesh), init_kv_cache(config, 8, 4, "float32", mesh), batch
            )
            lines[f"{'scan' if scan else 'loop'}{layers}"] = len(lowered.as_text().splitlines())
    print(json.dumps(dict(kind="program_size", **lines)), flush=True)


def check_all(root: Path) -> None:
    """Subprocess entry point (8 devices)."""
    import jax

    assert len(jax.devices()) == 8
    check_engine(root)
    check_skew_change(root)
    check_program_size()


@pytest.fixture(scope="module")
def online_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("eplb_online")
    return {
        r["kind"]: r
        for r in run_on_cpu_devices("test_eplb_online", "check_all", root, unset_env=("EXPERT_STATISTIC_ITER_RANGE",))
    }


def test_tokens_identical_with_balancer_moving_slots_and_nothing_recompiles(online_results):
    r = online_results["engine"]
    assert r["worker_error"] == "None"
    assert len(r["on"]) == 16 and all(len(t) == 24 for t in r["on"].values())
    assert r["on"] == r["off"], "greedy tokens changed when the balancer moved slots"
    assert r["mixed"]
    # both MoE layers rebalanced many times, most slots rewritten several times over
    assert r["rebalances"] >= 6 and r["slots_rewritten"] >= 4 * NUM_SLOTS, (r["rebalances"], r["slots_rewritten"])
    assert r["compiles_after_warmup"] == 0
    assert not r["worker_alive"], "close() leaves the placement thread running"
    last = r["lb_stats"][-1]
    assert set(last["layerImbalance"]) == {"1", "2"} and all(v >= 0 for v in last["layerImbalance"].values())
    assert last["rebalanceCount"] == r["rebalances"]
    counts = [s["rebalanceCount"] for s in r["lb_stats"]]
    assert counts == sorted(counts) and sum(bool(s["updatedLayers"]) for s in r["lb_stats"]) >= 6


def test_slot_layers_run_as_one_scan_whatever_the_depth(online_results):
    """The engine's two MoE slot layers are one stack (the balancer above rewrote rows of it), and
    the expert-parallel program does not grow with depth, where the unrolled loop does."""
    assert online_results["engine"]["stacked"]
    r = online_results["program_size"]
    assert r["scan3"] == r["scan5"], r
    assert r["loop5"] > r["loop3"] + 500 and r["scan5"] < r["loop5"], r


def test_statistics_recorded_while_balancing_feed_the_report(online_results):
    r = online_results["engine"]
    assert r["recorded_width"] == NUM_SLOTS, "per-slot counts while the placement changes"
    assert r["recorded_iters"] == list(range(2, 30))
    assert r["recorded_sums_ok"]
    lines = r["report"].splitlines()
    assert lines[0] == "Load statistics:" and lines[-1].startswith("average")
    assert [line.split()[0] for line in lines[2:-1]] == ["1", "2"]


def test_in_place_round_keeps_device_memory_and_addresses(online_results):
    rounds = online_results["engine"]["rounds"]
    assert len(rounds) >= 6
    for r in rounds:
        # Live arrays include the step loop's own small buffers, which may be freed meanwhile:
        # the round itself must leave nothing new behind.
        assert r["after"] <= r["before"], r
        assert r["donated"] and r["same_address"], r  # same shapes, shardings and device addresses


def test_imbalance_recovers_after_the_hot_set_switches(online_results):
    r = online_results["skew"]
    assert r["static_after"] > 0.4, "the switched bias must make the static placement badly imbalanced"
    assert r["recover_steps"] is not None and r["recover_steps"] <= RECOVERY_BOUND, r["recover_steps"]
    assert r["steady_after"] <= 0.10 and r["steady_before"] <= 0.10, r
    assert r["rebalances"] >= 2
    half = len(r["imbalance"]) // 2
    assert np.mean(r["imbalance"][half : half + 3]) > 2 * r["steady_after"], "the switch did not disturb the balance"


# ---------------------------------------------------------------------------------------------
# Host-side pieces (in process, no devices)


def test_hungarian_assignment_is_optimal():
    import itertools

    from sharding.eplb.mapping import min_cost_assignment

    rng = np.random.default_rng(0)
    for n in range(1, 7):
        for _ in range(10):
            cost = rng.integers(0, 9, (n, n)).astype(float)
            match = min_cost_assignment(cost)
            best = min(sum(cost[i, p[i]] for i in range(n)) for p in itertools.permutations(range(n)))
            assert sorted(match.tolist()) == list(range(n))
            assert cost[np.arange(n), match].sum() == pytest.approx(best)


def test_mapping_keeps_rank_loads_and_moves_fewer_slots():
    from sharding.eplb.load_metrics import imbalance_ratio, rank_loads, slot_loads
    from sharding.eplb.mapping import incremental_placement, map_onto, moved_slots
    from sharding.eplb.placement import greedy_placement

    rng = np.random.default_rng(1)
    num_experts, num_slots, ep = 64, 72, 8
    load = rng.pareto(1.2, num_experts) + 0.1
    current = greedy_placement(load, num_slots, ep)
    drifted = load * rng.uniform(0.8, 1.25, num_experts)
    new = greedy_placement(drifted, num_slots, ep)
    mapped = map_onto(current, new, ep)
    # the same multiset of experts per rank, ranks permuted: the same loads in another order
    assert sorted(rank_loads(slot_loads(drifted, mapped), ep).tolist()) == pytest.approx(
        sorted(rank_loads(slot_loads(drifted, new), ep).tolist())
    )
    assert sorted(mapped.tolist()) == sorted(new.tolist())
    assert moved_slots(current, mapped).size < moved_slots(current, new).size
    # moving from the current table reaches the fresh placement's imbalance with fewer rewrites still
    fresh = float(imbalance_ratio(rank_loads(slot_loads(drifted, new), ep)))
    closer = incremental_placement(drifted, current, ep, fresh + 0.01, max_moved=moved_slots(current, mapped).size)
    assert closer is not None and np.unique(closer).size == num_experts
    assert float(imbalance_ratio(rank_loads(slot_loads(drifted, closer), ep))) <= fresh + 0.01
    assert moved_slots(current, closer).size < moved_slots(current, mapped).size
    assert map_onto(current, current, ep).tolist() == current.tolist()
    # a rank-order shuffle of the same placement moves nothing
    shuffled = current.reshape(ep, -1)[rng.permutation(ep)]
    shuffled = np.stack([row[rng.permutation(row.size)] for row in shuffled]).reshape(-1)
    assert moved_slots(current, map_onto(current, shuffled, ep)).size == 0


def test_worker_skips_small_gains_and_never_blocks():
    import time

    from sharding.eplb.online import PlacementWorker, predicted_imbalance
    from sharding.slot_table import default_assignment

    table = default_assignment(8, 8, 4)
    worker = PlacementWorker(num_slots=8, ep_size=4, min_imbalance_gain=0.05)
    try:
        even = np.ones((1, 8))
        assert worker.submit(even, {5: table}, [5]) and worker.wait_idle()
        assert worker.take(5) is None and worker.stats.skipped_small_gain == 1
        skewed = np.array([[8.0, 7.0, 1, 1, 1, 1, 1, 1]])  # experts 0 and 1 share rank 0
        assert worker.submit(skewed, {5: table}, [5]) and worker.wait_idle()
        update = worker.take(5)
        assert update is not None and worker.take(5) is None
        assert (
            update.imbalance_after < update.imbalance_before == pytest.approx(predicted_imbalance(skewed[0], table, 4))
        )
        assert np.array_equal(update.based_on, table)
        # A busy worker refuses a snapshot at once instead of waiting: these loads keep it busy
        # (it reads them back on its thread) until released.
        held = _HeldLoads(skewed)
        assert worker.submit(held, {5: table}, [5])
        start = time.perf_counter()
        assert not worker.submit(skewed, {5: table}, [5])
        assert time.perf_counter() - start < 0.1
        held.release.set()
        assert worker.wait_idle()
    finally:
        worker.close()
    assert not worker.alive


class _HeldLoads:
    """Loads whose read-back (`np.asarray` on the worker thread) waits until `release` is set."""

    def __init__(self, loads: np.ndarray) -> None:
        self.loads = loads
        self.release = threading.Event()

    def __array__(self, dtype=None, copy=None):
        self.release.wait(30)
        return np.asarray(self.loads, dtype=dtype)


def test_slot_counts_follow_round_robin_replica_choice():
    import jax.numpy as jnp

    from jaxllm.engine.load_balancer import slot_counts
    from sharding.slot_table import choose_slots, make_slot_table

    rng = np.random.default_rng(2)
    table = np.array([3, 0, 1, 3, 2, 3, 0, 1], np.int32)
    ids = rng.integers(0, 4, (37, 2)).astype(np.int32)
    slots = np.asarray(choose_slots(jnp.asarray(ids), make_slot_table(table, 4)))
    expected = np.bincount(slots.reshape(-1), minlength=table.size)
    assert slot_counts(np.bincount(ids.reshape(-1), minlength=4), table).tolist() == expected.tolist()


def test_online_config_fields():
    from sharding.eplb.eplb_config import MoeLoadBalancerConfig, load_eplb_config

    config = load_eplb_config(
        {
            "num_slots": 16,
            "layer_updates_per_iter": 2,
            "min_imbalance_gain": 0.05,
            "placement_algorithm": "greedy",
            "minimize_moves": False,
        }
    )
    assert (config.layer_updates_per_iter, config.min_imbalance_gain, config.minimize_moves) == (2, 0.05, False)
    with pytest.raises(ValueError, match="placement_algorithm"):
        MoeLoadBalancerConfig(layer_updates_per_iter=1, placement_algorithm="fast")
    with pytest.raises(ValueError, match="min_imbalance_gain"):
        MoeLoadBalancerConfig(layer_updates_per_iter=1, min_imbalance_gain="much")
    with pytest.raises(ValueError, match="unknown expert load balancer field"):
        load_eplb_config({"num_slots": 16, "updates": 1})
