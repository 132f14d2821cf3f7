"""Offline EPLB: statistics files, imbalance report, placement algorithms, placement YAML, CLI.

Pure numpy (no model, no device). Expected values come from DeepSeek's published EPLB
example, hand computations and brute force over every slot table of small cases.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import save_file

from sharding.eplb import (
    ALGORITHMS,
    ExpertStatisticsWriter,
    MoeLoadBalancerConfig,
    compute_placement,
    load_eplb_config,
    load_expert_statistics,
    placement_from_counts,
    rebalance_experts,
    replicate_by_load,
    write_expert_statistics,
)
from sharding.eplb.cli import main as eplb_main
from sharding.eplb.load_metrics import load_statistics, rank_loads, slot_loads

REPO = Path(__file__).resolve().parents[1]


def _max_rank_load(load: np.ndarray, table: np.ndarray, ep_size: int) -> float:
    return float(rank_loads(slot_loads(load, table), ep_size).max())


# ----------------------------------------------------------------------------- algorithms
def test_deepseek_published_example_reproduces():
    weight = np.array(
        [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86], [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
    )
    phy2log, log2phy, logcnt = rebalance_experts(weight, num_replicas=16, num_groups=4, num_nodes=2, num_gpus=8)
    assert phy2log.tolist() == [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
    for layer in range(2):  # the other two outputs agree with phy2log
        assert logcnt[layer].tolist() == np.bincount(phy2log[layer], minlength=12).tolist()
        for expert in range(12):
            slots = log2phy[layer, expert][log2phy[layer, expert] >= 0]
            assert sorted(slots.tolist()) == np.flatnonzero(phy2log[layer] == expert).tolist()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("num_experts,num_slots,ep_size", [(8, 8, 4), (12, 16, 4), (16, 24, 8), (6, 9, 3)])
def test_every_algorithm_gives_a_valid_placement(algorithm, num_experts, num_slots, ep_size):
    rng = np.random.default_rng(num_slots)
    loads = np.stack(
        [
            rng.zipf(1.5, num_experts).astype(float),
            np.zeros(num_experts),
            rng.integers(0, 100, num_experts).astype(float),
        ]
    )
    tables = compute_placement(loads, num_slots, ep_size, algorithm)
    assert tables.shape == (3, num_slots)
    for table, load in zip(tables, loads):
        assert set(table.tolist()) == set(range(num_experts))  # every expert has a slot
        per_rank = table.reshape(ep_size, -1)  # slots divide evenly: num_slots / ep_size each
        assert per_rank.shape == (ep_size, num_slots // ep_size)
        counts = np.bincount(table, minlength=num_experts)
        assert counts.sum() == num_slots
        # an expert's tokens split over its replicas: the slot loads add back up to the load
        np.testing.assert_allclose(slot_loads(load, table).sum(), load.sum())
    if algorithm == "greedy":  # zero load: S // E replicas each, the first S % E one more
        expected = np.full(num_experts, num_slots // num_experts)
        expected[: num_slots % num_experts] += 1
        assert np.bincount(tables[1], minlength=num_experts).tolist() == expected.tolist()


def test_greedy_hand_example():
    # loads 10, 1, 4, 6 into 6 slots on 2 ranks. Replication: spare slots to expert 0
    # (10/1), then expert 3 (6/1 > 10/2 = 5). Shares 5, 1, 4, 3. Replicas heaviest first:
    # 0 -> r0 (5), 0 -> r1 (5), 2 -> r0 (9), 3 -> r1 (8), 3 -> r1 (11, r1 now full), 1 -> r0 (10).
    load = np.array([10.0, 1.0, 4.0, 6.0])
    assert replicate_by_load(load, 6).tolist() == [2, 1, 1, 2]
    table = compute_placement(load, 6, 2, "greedy")
    assert table.tolist() == [0, 2, 1, 0, 3, 3]
    assert rank_loads(slot_loads(load, table), 2).tolist() == [10.0, 11.0]


def test_replication_minimises_the_largest_share_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(20):
        num_experts = int(rng.integers(2, 5))
        num_slots = num_experts + int(rng.integers(0, 4))
        load = rng.integers(1, 60, num_experts).astype(float)
        best = min(
            max(load / np.array(c))
            for c in itertools.product(range(1, num_slots + 1), repeat=num_experts)
            if sum(c) == num_slots
        )
        assert max(load / replicate_by_load(load, num_slots)) == pytest.approx(best)


def test_balanced_never_worse_than_the_references_on_small_cases_brute_force():
    rng = np.random.default_rng(2)
    optimal = {a: 0 for a in ALGORITHMS}
    for _ in range(30):
        num_experts = int(rng.integers(3, 5))
        ep_size = int(rng.choice([2, 3]))
        num_slots = 6
        load = rng.integers(0, 50, num_experts).astype(float)
        best = min(
            _max_rank_load(load, np.array(t), ep_size)
            for t in itertools.product(range(num_experts), repeat=num_slots)
            if len(set(t)) == num_experts
        )
        got = {a: _max_rank_load(load, compute_placement(load, num_slots, ep_size, a), ep_size) for a in ALGORITHMS}
        assert got["balanced"] <= min(got["greedy"], got["hierarchical"]) + 1e-9
        for a in ALGORITHMS:
            assert got[a] >= best - 1e-9
            optimal[a] += got[a] <= best + 1e-9
    # the brute-force optimum is reached more often than by either reference
    assert optimal["balanced"] > max(optimal["greedy"], optimal["hierarchical"]), optimal


def test_balanced_beats_the_references_on_held_out_skewed_iterations():
    from jaxllm.bench.eplb import heldout_imbalance, skewed_routing_counts

    score = {a: [] for a in ALGORITHMS}
    for seed in range(3):  # the benchmark's workload, 4 layers: fit on 50 iterations, measure the next 50
        counts = skewed_routing_counts(num_iters=100, num_layers=4, num_experts=64, top_k=8, tokens=512, seed=seed)
        for a in ALGORITHMS:
            score[a].append(heldout_imbalance(counts[50:], placement_from_counts(counts[:50], 80, 8, a), 8))
    mean = {a: float(np.mean(v)) for a, v in score.items()}
    assert mean["balanced"] < 0.95 * min(mean["greedy"], mean["hierarchical"]), mean


def test_bad_placement_requests_are_value_errors():
    with pytest.raises(ValueError, match="smaller than"):
        compute_placement(np.ones(8), 4, 2)
    with pytest.raises(ValueError, match="multiple of ep_size"):
        compute_placement(np.ones(8), 9, 2)
    with pytest.raises(ValueError, match="unknown placement algorithm"):
        compute_placement(np.ones(8), 8, 2, "magic")


# ----------------------------------------------------------------------------- metrics
def test_imbalance_metrics_hand_example():
    # 4 experts on 2 ranks. Iteration 1: ranks 10+30=40, 20+40=60: mean 50, std
    # sqrt((10^2 + 10^2) / 1) = 14.1421, imbalance 60/50 - 1 = 0.2. Iteration 2: ranks 10, 10.
    counts = np.array([[10, 30, 20, 40], [5, 5, 5, 5]])
    assert rank_loads(counts, 2).tolist() == [[40, 60], [10, 10]]
    stats = load_statistics(rank_loads(counts, 2))
    assert stats["mean"] == pytest.approx(30.0)
    assert stats["std"] == pytest.approx(np.sqrt(200) / 2)
    assert stats["imbalance-ratio"] == pytest.approx(0.1)
    # expert 3 on two slots: 40 tokens become 20 + 20
    assert slot_loads(counts[0], np.array([0, 3, 1, 2, 3, 3])).tolist() == pytest.approx(
        [10, 40 / 3, 30, 20, 40 / 3, 40 / 3]
    )


# ----------------------------------------------------------------------------- statistics files
def test_writer_records_only_the_iteration_range_and_round_trips(tmp_path):
    writer = ExpertStatisticsWriter(tmp_path / "stats", 3, 6, num_experts_per_token=2, ep_size=4, layer_ids=[1, 3])
    rng = np.random.default_rng(0)
    steps = {it: rng.integers(0, 50, (2, 8)) for it in range(8)}
    for it in range(6):
        assert writer.wants(it) == (3 <= it < 6)
        writer.record(it, steps[it])
    assert not (tmp_path / "stats").exists()  # written when the loop reaches iteration 6
    writer.record(6, steps[6])
    writer.record(7, steps[7])
    meta = json.loads((tmp_path / "stats" / "meta_info.json").read_text())
    assert meta == {"num_experts": 8, "num_experts_per_token": 2, "ep_size": 4}
    stats = load_expert_statistics(tmp_path / "stats")
    assert stats.iters == [3, 4, 5] and stats.layers == [1, 3] and stats.ep_size == 4
    np.testing.assert_array_equal(stats.counts, np.stack([steps[3], steps[4], steps[5]]))
    np.testing.assert_array_equal(stats.layer_counts(3), np.stack([steps[i][1] for i in (3, 4, 5)]))
    assert load_expert_statistics(tmp_path / "stats", iter_start=4, iter_stop=5).iters == [4]


def test_writer_from_env(tmp_path, monkeypatch):
    monkeypatch.delenv("EXPERT_STATISTIC_ITER_RANGE", raising=False)
    assert ExpertStatisticsWriter.from_env(num_experts_per_token=2) is None  # collection off
    monkeypatch.setenv("EXPERT_STATISTIC_ITER_RANGE", "10-12")
    monkeypatch.delenv("EXPERT_STATISTIC_PATH", raising=False)
    with pytest.raises(ValueError, match="EXPERT_STATISTIC_PATH"):
        ExpertStatisticsWriter.from_env(num_experts_per_token=2)
    monkeypatch.setenv("EXPERT_STATISTIC_PATH", str(tmp_path / "s"))
    writer = ExpertStatisticsWriter.from_env(num_experts_per_token=2)
    assert (writer.iter_start, writer.iter_stop, writer.path) == (10, 12, str(tmp_path / "s"))
    for bad in ("10", "a-b", "12-10", "1-2-3"):
        monkeypatch.setenv("EXPERT_STATISTIC_ITER_RANGE", bad)
        with pytest.raises(ValueError, match="EXPERT_STATISTIC_ITER_RANGE"):
            ExpertStatisticsWriter.from_env(num_experts_per_token=2)


def test_reader_sums_rank_files_as_the_reference_writes_them(tmp_path):
    # two ranks, each its own tokens' counts; no ep_size in meta: the number of rank files
    (tmp_path / "meta_info.json").write_text(json.dumps({"num_experts": 4, "num_experts_per_token": 1}))
    save_file(
        {"5_0": np.array([1, 2, 3, 4], np.int32), "6_0": np.array([0, 0, 1, 1], np.int32)},
        str(tmp_path / "rank0.safetensors"),
    )
    save_file(
        {"5_0": np.array([1, 1, 1, 1], np.int32), "6_0": np.array([2, 0, 0, 0], np.int32)},
        str(tmp_path / "rank1.safetensors"),
    )
    stats = load_expert_statistics(tmp_path)
    assert stats.ep_size == 2 and stats.iters == [5, 6]
    assert stats.counts[:, 0].tolist() == [[2, 3, 4, 5], [2, 0, 1, 1]]


# ----------------------------------------------------------------------------- report, YAML, CLI
@pytest.fixture
def hand_stats(tmp_path):
    counts = np.array([[[10, 30, 20, 40], [1, 1, 1, 1]], [[5, 5, 5, 5], [0, 2, 2, 0]]])  # [iters, layers, experts]
    write_expert_statistics(
        tmp_path / "hand", counts, iter_start=100, num_experts_per_token=2, ep_size=2, layer_ids=[3, 4]
    )
    return tmp_path / "hand"


def test_report_prints_the_reference_table(hand_stats, capsys):
    assert eplb_main(["report", "--expert_statistic_path", str(hand_stats)]) == 0
    # layer 3: see test_imbalance_metrics_hand_example. layer 4: ranks [2, 2] and [2, 2].
    assert capsys.readouterr().out == (
        "Load statistics:\n"
        "         mean       std  imbalance-ratio\n"
        "3        30.0  7.071068             0.10\n"
        "4         2.0  0.000000             0.00\n"
        "average  16.0  3.535534             0.05\n"
    )  # a column's trailing zeros trimmed alike, as pandas
    assert eplb_main(["report", "--expert-statistic-path", str(hand_stats), "--per-expert", "--iter-start", "101"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # per slot, iteration 101 only: layer 4 = [0, 2, 2, 0]: mean 1, std sqrt(4/3), imbalance 1
    assert lines[3].split() == ["4", "1.0", f"{np.sqrt(4 / 3):.6f}", "1.0"]


def test_report_errors_are_one_line(tmp_path, capsys):
    assert eplb_main(["report", "--expert_statistic_path", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxllm eplb report: error:") and err.count("\n") == 1


def test_generate_config_yaml_round_trips_and_balances(hand_stats, tmp_path, capsys):
    out = tmp_path / "eplb.yaml"
    assert (
        eplb_main(
            [
                "generate-config",
                "--expert_statistic_path",
                str(hand_stats),
                "--ep_size",
                "2",
                "--num_slots",
                "6",
                "--output_path",
                str(out),
                "--layer_updates_per_iter",
                "1",
                "--algorithm",
                "greedy",
            ]
        )
        == 0
    )
    raw = yaml.safe_load(out.read_text())
    assert set(raw) == {"num_slots", "initial_global_assignments", "layer_updates_per_iter"}
    assert "3: [" in out.read_text()  # one slot list per line
    config = load_eplb_config(out)
    assert isinstance(config, MoeLoadBalancerConfig)
    assert config.num_slots == 6 and config.layer_updates_per_iter == 1
    assert sorted(config.initial_global_assignments) == [3, 4]
    config.validate(num_experts=4, ep_size=2)
    # layer 3's summed loads [15, 35, 25, 45] -> greedy: independent of the CLI path
    assert (
        config.initial_global_assignments[3] == compute_placement(np.array([15.0, 35, 25, 45]), 6, 2, "greedy").tolist()
    )
    assert load_eplb_config(config.to_dict()) == config
    capsys.readouterr()
    assert (
        eplb_main(["report", "--expert_statistic_path", str(hand_stats), "--projection_eplb_config_path", str(out)])
        == 0
    )
    projected = capsys.readouterr().out.splitlines()
    assert float(projected[1 + 1].split()[-1]) < 0.1  # layer 3 better than without the placement


def test_config_rejects_bad_tables():
    with pytest.raises(ValueError, match="has 3 slots, num_slots is 4"):
        MoeLoadBalancerConfig(num_slots=4, initial_global_assignments={0: [0, 1, 2]})
    config = MoeLoadBalancerConfig(num_slots=4, initial_global_assignments={0: [0, 1, 1, 1]})
    with pytest.raises(ValueError, match=r"experts \[2\] have no slot"):
        config.validate(num_experts=3, ep_size=2)
    with pytest.raises(ValueError, match="unknown expert load balancer field"):
        load_eplb_config({"num_slots": 4, "slots": []})
    with pytest.raises(ValueError, match="layer_updates_per_iter"):
        MoeLoadBalancerConfig(layer_updates_per_iter=-1)


def test_report_plot_writes_pngs(hand_stats, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert (
        eplb_main(
            [
                "report",
                "--expert_statistic_path",
                str(hand_stats),
                "--plot",
                str(tmp_path / "png"),
                "--plot_layers",
                "3",
                "4",
            ]
        )
        == 0
    )
    names = sorted(os.listdir(tmp_path / "png"))
    assert names == ["layer3_ranks.png", "layer3_slots.png", "layer4_ranks.png", "layer4_slots.png"]
    assert (tmp_path / "png" / "layer3_ranks.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_example_scripts_run(hand_stats, tmp_path):
    examples = REPO / "examples" / "ep_load_balancer"
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def run(script, *args):
        return subprocess.run(
            [sys.executable, str(examples / script), *args], capture_output=True, text=True, env=env, timeout=120
        )

    for script in ("report_load_statistics.py", "generate_eplb_config.py"):
        done = run(script, "--help")
        assert done.returncode == 0 and "--expert_statistic_path" in done.stdout
    out = tmp_path / "moe_load_balancer.yaml"
    done = run(
        "generate_eplb_config.py",
        "--ep_size",
        "2",
        "--num_slots",
        "6",
        "--expert_statistic_path",
        str(hand_stats),
        "--output_path",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    assert load_eplb_config(out).num_slots == 6
    done = run("report_load_statistics.py", "--expert_statistic_path", str(hand_stats))
    assert done.returncode == 0 and done.stdout.startswith("Load statistics:") and "average" in done.stdout


def test_bench_eplb_prints_the_table(capsys):
    from jaxllm.bench.eplb import main
    from jaxllm.cli.bench import BENCHMARKS

    assert BENCHMARKS["eplb"] == "jaxllm.bench.eplb"
    assert (
        main(["--iters", "8", "--layers", "1", "--experts", "16", "--ep-size", "4", "--top-k", "2", "--tokens", "64"])
        == 0
    )
    out = capsys.readouterr().out
    for row in ("no EPLB", "greedy, 0% redundant", "hierarchical, 25% redundant", "balanced, 25% redundant"):
        assert row in out
