"""Benchmark tools: datasets, metrics, and the throughput / latency / serving CLIs end to end."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from jaxllm.bench import latency, serve_client, startup, throughput
from jaxllm.bench.dataset import BenchRequest, load_dataset, save_dataset, synthetic_dataset
from jaxllm.bench.request_metrics import RequestRecord, distribution, format_table, summarize
from jaxllm.executor import GenerationExecutor
from jaxllm.server.app import build_app
from jaxllm.server.server_config import ServerConfig

from conftest import tiny_engine
from server_helpers import LiveServer
from server_helpers import live_threads as _threads

ENGINE_ARGS = [
    "--model",
    "tiny-moe",
    "--max-batch-size",
    "8",
    "--max-num-tokens",
    "16",
    "--max-seq-len",
    "128",
    "--tokens-per-block",
    "8",
    "--kv-cache-max-tokens",
    "2048",
    "--no-progress",
]


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture
def reuse_engine(engine, monkeypatch):
    """The CLIs build their own engine; hand them the module's (already compiled) one instead."""
    monkeypatch.setattr(throughput, "build_engine", lambda args: engine)
    monkeypatch.setattr(latency, "build_engine", lambda args: engine)
    return engine


# ---------------------------------------------------------------------------- datasets
def test_synthetic_dataset_follows_the_distributions(tmp_path):
    reqs = synthetic_dataset(
        400, input_mean=40, input_stdev=8, output_mean=20, output_stdev=4, vocab_size=300, exclude_ids=[0, 1, 2], seed=1
    )
    ins = np.array([len(r.input_ids) for r in reqs])
    outs = np.array([r.output_tokens for r in reqs])
    assert abs(ins.mean() - 40) < 2 and abs(ins.std() - 8) < 2
    assert abs(outs.mean() - 20) < 1.5 and outs.min() >= 1
    assert all(3 <= t < 300 for r in reqs for t in r.input_ids)
    const = synthetic_dataset(5, input_mean=7, output_mean=3, dist="constant")
    assert {len(r.input_ids) for r in const} == {7} and {r.output_tokens for r in const} == {3}
    uni = synthetic_dataset(200, input_mean=50, input_stdev=10, output_mean=5, dist="uniform")
    assert all(40 <= len(r.input_ids) <= 60 for r in uni)
    capped = synthetic_dataset(20, input_mean=100, input_stdev=30, output_mean=100, max_seq_len=128)
    assert all(len(r.input_ids) + r.output_tokens <= 128 for r in capped)
    path = tmp_path / "data.jsonl"
    save_dataset(path, reqs[:10] + [BenchRequest(task_id="text", output_tokens=4, prompt="hello")])
    loaded = load_dataset(path)
    assert [r.to_json() for r in loaded] == [r.to_json() for r in reqs[:10]] + [
        {"task_id": "text", "prompt": "hello", "output_tokens": 4}
    ]
    assert len(load_dataset(path, num_requests=3)) == 3


@pytest.mark.parametrize(
    "line,message",
    [
        ('{"task_id": 1, "input_ids": [1, 2]}', "output_tokens"),
        ('{"task_id": 1, "input_ids": [1, 2], "prompt": "x", "output_tokens": 3}', "exactly one"),
        ('{"task_id": 1, "input_ids": [], "output_tokens": 3}', "input_ids"),
        ('{"task_id": 1, "prompt": "x", "output_tokens": 0}', "output_tokens"),
        ('{"task_id": 1, "prompt": "x", "output_tokens": 3, "extra": 1}', "unknown"),
        ('[1, 2]', "JSON object"),
        ('{not json', "line"),
    ],
)
def test_bad_dataset_lines_are_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"task_id": 0, "prompt": "ok", "output_tokens": 2}\n' + line + "\n")
    with pytest.raises(ValueError, match=message) as info:
        load_dataset(path)
    assert ":2:" in str(info.value)


# ---------------------------------------------------------------------------- metrics
def test_metrics_follow_the_reference_formulas():
    a = RequestRecord(
        input_tokens=10, start=0.0, output_tokens=5, first_token=0.1, end=0.5, chunk_times=[0.1, 0.2, 0.3, 0.4, 0.5]
    )
    b = RequestRecord(
        input_tokens=20, start=0.2, output_tokens=3, first_token=0.4, end=1.0, chunk_times=[0.4, 0.6, 1.0]
    )
    failed = RequestRecord(input_tokens=5, start=0.1, error="boom")
    s = summarize([a, b, failed], slo_ttft_ms=150)
    assert s["num_completed"] == 2 and s["num_failed"] == 1
    assert s["duration_s"] == pytest.approx(1.0)
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_token_throughput"] == pytest.approx(8.0)
    assert s["total_token_throughput"] == pytest.approx(38.0)
    assert s["ttft_ms"]["min"] == pytest.approx(100) and s["ttft_ms"]["max"] == pytest.approx(200)
    assert s["tpot_ms"]["mean"] == pytest.approx(((0.4 / 4) + (0.6 / 2)) / 2 * 1e3)
    assert sorted([s["itl_ms"]["min"], s["itl_ms"]["max"]]) == pytest.approx([100, 400])
    assert s["e2e_latency_ms"]["p50"] == pytest.approx(650)
    assert s["goodput"]["fraction"] == pytest.approx(1 / 3)
    d = distribution(list(np.arange(1, 101) / 1e3))
    assert d["p50"] == pytest.approx(50.5) and d["p99"] == pytest.approx(99.01)
    table = format_table(s, "unit")
    for row in ("TTFT", "TPOT", "ITL", "E2E", "req/s", "tok/s", "p99"):
        assert row in table
    assert distribution([])["p90"] is None


# ---------------------------------------------------------------------------- CLIs
def test_throughput_cli_runs_every_backend(reuse_engine, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    save_dataset(
        data,
        synthetic_dataset(
            12,
            input_mean=12,
            input_stdev=4,
            output_mean=6,
            output_stdev=2,
            vocab_size=400,
            exclude_ids=[0, 1, 2],
            seed=3,
        ),
    )
    expected = sum(r.output_tokens for r in load_dataset(data))
    report = tmp_path / "report.json"
    rc = throughput.main(
        ENGINE_ARGS + ["--dataset", str(data), "--backend", "all", "--concurrency", "6", "--report-json", str(report)]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "throughput: executor" in out and "throughput: llm" in out and "throughput: engine" in out
    runs = json.loads(report.read_text())["runs"]
    assert set(runs) == {"executor", "llm", "engine"}
    for run in runs.values():
        assert run["num_completed"] == 12 and run["total_output_tokens"] == expected  # EOS ignored
        assert run["output_token_throughput"] > 0
    for name in ("executor", "engine"):
        assert runs[name]["ttft_ms"]["p50"] is not None and runs[name]["tpot_ms"]["p99"] is not None
    assert runs["executor"]["itl_ms"]["p90"] is not None
    # synthetic data with the length options
    rc = throughput.main(
        ENGINE_ARGS
        + [
            "--num-requests",
            "4",
            "--input-mean",
            "10",
            "--output-mean",
            "5",
            "--dist",
            "constant",
            "--save-dataset",
            str(tmp_path / "syn.jsonl"),
        ]
    )
    assert rc == 0 and len(load_dataset(tmp_path / "syn.jsonl")) == 4


def test_latency_cli(monkeypatch, tmp_path, capsys):
    # Fresh tiny engines (each run closes its engine), compiled on demand.
    monkeypatch.setattr(
        latency,
        "build_engine",
        lambda args, decode_buckets=True: tiny_engine(**({} if decode_buckets else {"decode_batch_sizes": []})),
    )
    report = tmp_path / "latency.json"
    rc = latency.main(
        ENGINE_ARGS
        + [
            "--concurrency",
            "1",
            "3",
            "--num-requests",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "6",
            "--report-json",
            str(report),
        ]
    )
    assert rc == 0
    results = json.loads(report.read_text())["results"]
    assert set(results) == {"jaxllm", "jaxllm, decode buckets off", "HF transformers"}
    for levels in results.values():
        # Level 3 runs 3 requests (at least its concurrency), each exactly 6 tokens.
        assert [levels[c]["output_tokens"] for c in ("1", "3")] == [12, 18]
        assert levels["3"]["ttft_p99"] is not None and levels["3"]["itl_p50"] is not None
    table = capsys.readouterr().out
    assert "tok/s ÷HF" in table and "batched generate" in table


def test_serving_client_load_shapes(engine, tmp_path, capsys):
    before = _threads()
    executor = GenerationExecutor(engine)
    server = LiveServer(build_app(executor, ServerConfig(served_model_name="tiny-moe")))
    try:
        requests = synthetic_dataset(
            10,
            input_mean=10,
            input_stdev=3,
            output_mean=5,
            output_stdev=2,
            vocab_size=400,
            exclude_ids=[0, 1, 2],
            seed=4,
        )
        expected = sum(r.output_tokens for r in requests)
        # `jaxllm bench startup`'s first requests: streamed completions sent at once, each timed.
        ttfts = startup.first_ttfts(server.url, startup.first_request_prompts(2))
        assert len(ttfts) == 2 and all(0 < t < 60 for t in ttfts)
        for load, kwargs in (("all", {}), ("concurrency", {"concurrency": 3}), ("poisson", {"request_rate": 40.0})):
            started = time.perf_counter()
            records, wall = asyncio.run(
                serve_client.run_load(server.url, "tiny-moe", requests, load=load, progress=False, **kwargs)
            )
            assert all(r.ok for r in records), [r.error for r in records]
            assert sum(r.output_tokens for r in records) == expected
            assert [r.input_tokens for r in records] == [len(r.input_ids) for r in requests]
            assert 0 < wall <= time.perf_counter() - started
            s = summarize(records, wall_time=wall)
            assert s["ttft_ms"]["p50"] is not None and s["itl_ms"]["p50"] is not None
        with pytest.raises(ValueError, match="concurrency"):
            asyncio.run(serve_client.run_load(server.url, "tiny-moe", requests, load="concurrency"))
        data = tmp_path / "data.jsonl"
        save_dataset(data, requests)
        report = tmp_path / "serve.json"
        rc = serve_client.main(
            [
                "--url",
                server.url,
                "--dataset",
                str(data),
                "--load",
                "concurrency",
                "--concurrency",
                "4",
                "--no-progress",
                "--report-json",
                str(report),
            ]
        )
        assert rc == 0
        assert json.loads(report.read_text())["total_output_tokens"] == expected
        assert "serving: concurrency 4" in capsys.readouterr().out
    finally:
        server.stop()
        executor.shutdown()
    assert not (_threads() - before)
    stats = engine.kv_cache_manager.get_kv_cache_stats()
    assert stats.free_num_blocks == stats.max_num_blocks


def test_host_overhead_cli_prints_the_step_timing_columns(capsys):
    """`jaxllm bench host` on a random model it writes (a 2048-token vocabulary, one layer of
    16): per step host CPU and wall time without device waits, blocking reads, device and
    idle time, with and without the overlap scheduler."""
    from jaxllm.bench import host_overhead

    argv = ["--vocab-size", "2048", "--num-layers", "1", "--hidden-size", "16", "--running", "2", "--steps", "4"]
    assert host_overhead.main(argv) == 0
    table = capsys.readouterr().out.splitlines()[-4:]

    def fields(line: str) -> dict[str, str]:  # the table's columns are right-aligned, fixed widths
        out, start = {}, 0
        for name, width, _ in host_overhead._COLUMNS:
            out[name] = line[start : start + width].strip()
            start += width + 1
        return out

    assert fields(table[0]) == {name: name for name, _, _ in host_overhead._COLUMNS}
    rows = {row["overlap"]: row for row in map(fields, table[2:])}
    assert set(rows) == {"on", "off"}
    for row in rows.values():
        # A steady decode step makes one blocking read with the overlap scheduler and without.
        assert row["reads/step"] == "1.00"
        for column in ("host cpu ms", "host wall ms", "device ms", "idle ms p50"):
            assert float(row[column]) >= 0, column
    with pytest.raises(SystemExit):
        host_overhead.main(["--num-layers", "2"])  # shapes only the --vocab-size model
