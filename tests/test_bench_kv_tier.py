"""`jaxllm bench kv-tier` runs end to end on a small workload: the three modes, the same tokens,
and the host tier computing the unbounded pool's prefill where the tier-off pool recomputes."""

from __future__ import annotations

from jaxllm.cli import main


def test_kv_tier_bench_prints_three_modes_with_the_same_tokens(capsys):
    argv = ["bench", "kv-tier", "--conversations", "4", "--turns", "2", "--concurrency", "2"]
    argv += ["--system-len", "32", "--user-len", "8", "--output-len", "4", "--tokens-per-block", "8"]
    argv += ["--device-tokens", "64", "--host-size", "4MiB", "--no-warmup"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = {
        line.split()[0]: line.split()
        for line in out.splitlines()
        if line.split()[:1] in (["off"], ["host"], ["unbounded"])
    }
    assert set(rows) == {"off", "host", "unbounded"}
    prefill = {mode: int(cols[1]) for mode, cols in rows.items()}
    assert prefill["host"] == prefill["unbounded"] < prefill["off"]
    assert "same greedy tokens in every mode: True" in out
