"""Benchmarks, each runnable as `jaxllm bench NAME` (see jaxllm.cli.bench.BENCHMARKS)."""
