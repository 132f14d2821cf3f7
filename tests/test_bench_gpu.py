"""`jaxllm bench gpu`: the dry run on CPU (every section, the report files and schema, no
server imports), failures and the time budget, the runner's mechanisms, the numerics fixture."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxllm.bench.gpu import SECTIONS
from jaxllm.bench.gpu.report import (
    FAIL_ENV,
    SCHEMA,
    SCHEMA_VERSION,
    STATUSES,
    Printer,
    RunOptions,
    Section,
    SectionSkipped,
    run_sections,
)

ROOT = Path(__file__).resolve().parents[1]
SERVER_MODULES = ("fastapi", "uvicorn", "pydantic")


def _run_command(
    tmp_path: Path,
    args: list[str],
    env_extra: dict[str, str] | None = None,
    timeout: float = 240,
    compile_cache: bool = True,
) -> tuple[subprocess.CompletedProcess, float]:
    """`python -m jaxllm.bench.gpu` from the checkout (PYTHONPATH, no install), with fastapi,
    uvicorn and pydantic made unimportable (modules on the path that raise ImportError).
    `compile_cache=False`: without the test session's compilation cache (conftest), so
    compiles take their real time."""
    blockers = tmp_path / "blockers"
    blockers.mkdir(exist_ok=True)
    for name in SERVER_MODULES:
        (blockers / f"{name}.py").write_text(f"raise ImportError('{name} is not installed here (test)')\n")
    env = dict(os.environ)
    env.pop(FAIL_ENV, None)
    if not compile_cache:
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        env["JAXLLM_COMPILE_CACHE"] = "0"
    env.update(PYTHONPATH=os.pathsep.join([str(blockers), str(ROOT)]), JAX_PLATFORMS="cpu", **(env_extra or {}))
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "jaxllm.bench.gpu", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - start


def _load(out: Path) -> dict:
    assert (out / "gpu_report.md").is_file()
    report = json.loads((out / "gpu_report.json").read_text())
    assert report["schema"] == SCHEMA and report["schema_version"] == SCHEMA_VERSION
    assert list(report["sections"]) == [s.key for s in SECTIONS]
    for section in report["sections"].values():
        assert section["status"] in STATUSES, section
    return report


def _rows(section: dict) -> list[dict]:
    return [row for table in section["tables"] for row in table["rows"]]


def test_dry_run_covers_every_section_without_the_server(tmp_path):
    out = tmp_path / "report"
    proc, _ = _run_command(tmp_path, ["--dry-run", "--out", str(out), "--budget-s", "100"])
    report = _load(out)
    sections = report["sections"]
    assert report["dry_run"] is True
    assert all(s["status"] != "failed" for s in sections.values()), {k: s["error"] for k, s in sections.items()}
    # 0 when every section ran to the end (or was skipped); a loaded machine may time some out.
    complete = all(s["status"] in ("ok", "skipped") for s in sections.values())
    assert proc.returncode == (0 if complete else 1), proc.stderr[-3000:]
    for module in SERVER_MODULES:  # the blockers were on the path: nothing imported the server
        assert f"{module} is not installed here" not in proc.stderr
    # The markdown is printed as it goes, and the file says it is a dry run.
    assert "## 1. Environment" in proc.stdout and "## 5. Numerics against CPU" in proc.stdout
    markdown = (out / "gpu_report.md").read_text()
    assert "DRY RUN" in markdown and all(s.title in markdown for s in SECTIONS)
    env = sections["env"]
    assert env["status"] == "ok" and env["data"]["copy_bytes_per_s"] > 0 and env["data"]["matmul_flops_per_s"] > 0
    assert env["data"]["auto_backends"] == {"attention": "xla", "moe": "xla"}
    ran = {k: s for k, s in sections.items() if s["status"] in ("ok", "timeout")}
    assert "kernels" in ran and "engine" in ran  # a loaded machine may cut some short, never skip them all
    checked = [r for r in _rows(sections["kernels"]) if r.get("passed") is not None]
    assert all(r["passed"] and r["rel_err"] < r["tol"] for r in checked)
    if sections["kernels"]["status"] == "ok":
        assert checked and any(r.get("note", "").startswith("skipped: tokamax") for r in _rows(sections["kernels"]))
    if sections["speed"]["status"] == "ok":
        assert all(r.get("ms") is None or r["ms"] > 0 for r in _rows(sections["speed"]))
        assert any(t["title"] == "Goals" and t["rows"] for t in sections["speed"]["tables"])
        assert any(r.get("model_ms") for r in _rows(sections["speed"]))
    if sections["engine"]["status"] == "ok":
        engine = sections["engine"]
        assert not engine["data"].get("case_errors"), engine["data"].get("case_errors")
        runs = engine["data"]["runs"]
        builds = {(b["backend"], b["attention_backend"], b["moe_backend"]) for b in engine["data"]["builds"]}
        assert builds == {("pallas", "pallas", "pallas"), ("xla", "xla", "xla")}  # Pallas in interpret mode
        assert {r["backend"] for r in runs} == {"pallas", "xla"}
        assert all(r["output_tok_s"] > 0 and r["failed"] == 0 and not r["cut"] for r in runs)
        per_step = [t for t in engine["tables"] if ": per step" in t["title"]]
        assert len(per_step) == 2 and all(len(t["rows"]) == 2 for t in per_step)  # 2 backends x 2 concurrencies
        step_columns = set(per_step[0]["columns"])
        assert {"host_cpu_ms", "host_wall_ms", "device_ms", "idle_ms", "idle_pct", "blocking_reads"} <= step_columns
        assert {"decode_device_ms", "step_gb", "mbu_pct", "flop_util_pct"} <= step_columns
        for r in runs:  # a decode step reads at most every weight and KV byte; the device was busy for it
            assert r["decode_steps"] > 0 and r["device_ms"] > 0 and 0 <= r["idle_share"] < 1
            build = next(b for b in engine["data"]["builds"] if b["backend"] == r["backend"])
            assert 0 < r["step_gb"] * 1e9 <= build["weight_bytes"] + build["kv_cache_bytes"]
            assert 0 < r["mbu"] and 0 < r["flop_util"]
            for column in ("host_cpu_ms", "host_wall_ms", "blocking_reads"):  # EngineTiming's per-step host numbers
                assert r[column] is not None and r[column] >= 0, (column, r)
        goals = next(t for t in engine["tables"] if t["title"] == "Goals")
        assert {row["goal"].split(",")[0] for row in goals["rows"]} >= {"decode MBU", "ITL p50 ms"}
    if sections["numerics"]["status"] == "ok":
        assert sections["numerics"]["data"]["failures"] == []


def test_injected_failure_is_recorded_and_the_budget_holds(tmp_path):
    out = tmp_path / "report"
    budget = 12.0
    proc, elapsed = _run_command(
        tmp_path,
        ["--dry-run", "--out", str(out), "--budget-s", str(budget)],
        env_extra={FAIL_ENV: "kernels"},
        compile_cache=False,
    )
    assert elapsed < budget + 6.0, f"took {elapsed:.1f}s for a {budget}s budget"  # + interpreter start-up
    assert proc.returncode == 1
    sections = _load(out)["sections"]
    kernels = sections["kernels"]
    assert kernels["status"] == "failed" and "InjectedFailure" in kernels["error"]
    assert "Traceback" in kernels["traceback"] and "InjectedFailure" in kernels["traceback"]
    assert sections["speed"]["status"] in ("timeout", "ok")  # the next section still ran, cut by the budget
    assert all(sections[k]["status"] in ("timeout", "skipped") for k in ("engine", "numerics"))


def test_unknown_section_is_refused(tmp_path):
    from jaxllm.bench.gpu import main

    assert main(["--out", str(tmp_path), "--sections", "env,nope", "--dry-run"]) == 2


def test_registered_as_jaxllm_bench_gpu():
    from jaxllm.cli import main
    from jaxllm.cli.bench import BENCHMARKS

    assert BENCHMARKS["gpu"] == "jaxllm.bench.gpu"
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "gpu", "--help"])
    assert exit_info.value.code == 0


def test_runner_statuses_time_shares_and_abandoned_threads(tmp_path, capsys):
    def ok(ctx):
        ctx.data["x"] = 1.5
        ctx.table("t", ("a",)).add(a=1)

    def boom(ctx):
        raise ValueError("broken on purpose")

    def skipped(ctx):
        raise SectionSkipped("no such backend here")

    def cooperative(ctx):
        while True:
            ctx.check_time("the next case")
            time.sleep(0.05)

    def hangs(ctx):
        ctx.table("late", ("a",))
        time.sleep(30)

    sections = [
        Section("ok", "Ok", 1, 1, ok),
        Section("boom", "Boom", 1, 1, boom),
        Section("skip", "Skip", 1, 1, skipped),
        Section("coop", "Coop", 1, 1, cooperative),
        Section("hang", "Hang", 1, 1, hangs),
        Section("after", "After", 1, 1, ok),
    ]
    start = time.monotonic()
    results, stuck = run_sections(
        sections, RunOptions(True, True, tmp_path), budget_s=8.0, started=start, printer=Printer()
    )
    elapsed = time.monotonic() - start
    by_key = {r.key: r for r in results}
    assert elapsed < 8.0 and stuck
    assert by_key["ok"].status == "ok" and by_key["ok"].data == {"x": 1.5} and by_key["ok"].tables[0].rows == [{"a": 1}]
    assert by_key["boom"].status == "failed" and "ValueError: broken on purpose" in by_key["boom"].traceback
    assert by_key["skip"].status == "skipped" and by_key["skip"].reason == "no such backend here"
    assert by_key["coop"].status == "timeout" and "before the next case" in by_key["coop"].reason
    assert by_key["hang"].status == "timeout" and "abandoned" in by_key["hang"].reason
    assert by_key["after"].status == "ok"  # the hung section's thread did not stop the next one
    assert all(r.time_share_s > 0 for r in results)
    printed = capsys.readouterr().out
    assert "| 1 |" in printed and "status: failed: ValueError: broken on purpose" in printed


def test_numerics_fixture_is_what_cpu_computes_now():
    from jaxllm.bench.gpu import numerics

    fixture = numerics.load_fixture()
    fresh = numerics.generate_fixture()
    assert fixture["platform"] == "cpu"
    assert {k: v for k, v in fresh.items() if k != "platform"} == {k: v for k, v in fixture.items() if k != "platform"}
    assert fixture["tokens"]["xla"] == fixture["tokens"]["pallas"]
