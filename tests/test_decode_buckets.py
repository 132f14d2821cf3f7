"""Small decode buckets (`EngineConfig.decode_batch_sizes`): a decode-only step of n rows runs in
the smallest decode bucket holding n. Proven against the engine without them: the same requests
give the same greedy tokens and logprobs (within 1e-5) whichever bucket each step ran in, and
after a full warm-up no step of 1..max_batch_size concurrent decodes compiles anything."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

from jaxllm.batch_builder import choose_decode_rows, decode_batch_sizes
from jaxllm.engine.engine_config import EngineConfig
from jaxllm.sampling import SamplingParams

from conftest import tiny_engine

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def test_the_bucket_of_k_rows_is_the_smallest_holding_k():
    assert decode_batch_sizes(64, 64) == [1, 2, 4, 8, 16, 32]  # serve's defaults: 64 rows in token bucket 64
    assert decode_batch_sizes(8, 16) == [1, 2, 4, 8]  # 8 rows are fewer than the 16-token bucket
    assert decode_batch_sizes(8, 16, [6, 3, 3, 12]) == [3, 6]  # up to max_batch_size
    assert decode_batch_sizes(8, 16, []) == []
    sizes = [1, 2, 4, 8]
    assert [choose_decode_rows(k, sizes) for k in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]
    assert [choose_decode_rows(k, [3, 6]) for k in range(1, 8)] == [3, 3, 3, 6, 6, 6, None]


@pytest.mark.parametrize("sizes, match", [([0], "positive"), ([4, 65], "at most max_batch_size"), ("1,2", "list")])
def test_bad_decode_batch_sizes_are_refused(sizes, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="tiny-moe", decode_batch_sizes=sizes)


def test_the_flag_takes_row_counts_or_off():
    import argparse

    from jaxllm.cli.args import decode_batch_sizes_flag

    assert decode_batch_sizes_flag("1,2,4") == [1, 2, 4] and decode_batch_sizes_flag("off") == []
    for bad in ("1,x", "0,2"):
        with pytest.raises(argparse.ArgumentTypeError):
            decode_batch_sizes_flag(bad)


def _staggered_run(**limits) -> tuple[list, list, dict]:
    """Requests join so that 1, then 3, then 8 decode together, then 2 are left (steps cross
    the buckets); returns each request's tokens and logprobs and the steps per token bucket."""
    engine = tiny_engine("tiny-moe", compile_ahead=False, **limits)
    try:
        rng = np.random.default_rng(7)
        requests = []
        logprobs: dict[int, list] = {}  # request id -> [(token, its logprob, top-2 logprobs)] per output

        def add(count: int, max_tokens: int) -> None:
            for _ in range(count):
                prompt = rng.integers(3, 300, int(rng.integers(3, 9))).tolist()
                params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
                requests.append(engine.add_request(prompt, params))

        def step() -> None:
            for update in engine.step():
                for token, entry in zip(update.new_token_ids, update.new_logprobs):
                    logprobs.setdefault(update.request.request_id, []).append(
                        [entry[token].logprob] + [lp.logprob for lp in entry.values() if lp.rank is not None]
                    )

        def steps(n: int) -> None:
            for _ in range(n):
                step()

        add(1, 40)  # decodes alone
        steps(4)
        add(2, 36)  # 3 decoding
        steps(5)
        add(5, 12)  # 8 decoding, then these 5 and ...
        while engine.has_unfinished_requests():  # ... 2 are left
            step()
        tokens = [list(r.output_token_ids) for r in requests]
        return tokens, [logprobs[r.request_id] for r in requests], dict(engine.runner.steps_per_bucket)
    finally:
        engine.close()


def test_tokens_and_logprobs_do_not_depend_on_the_decode_bucket():
    tokens_on, logprobs_on, buckets_on = _staggered_run()
    tokens_off, logprobs_off, buckets_off = _staggered_run(decode_batch_sizes=[])
    assert set(buckets_off) == {16}  # every step in the one token bucket
    assert {1, 4, 8} <= set(buckets_on)  # 1 -> 3 -> 8 -> 2 rows: decode buckets 1, 4, 8 and 2
    assert tokens_on == tokens_off
    for on, off in zip(logprobs_on, logprobs_off):
        assert len(on) == len(off) > 0
        np.testing.assert_allclose(on, off, atol=1e-5)


def test_no_compile_on_the_step_path_after_warm_up():
    engine = tiny_engine("tiny-moe")
    compiles: list[int] = []
    here = threading.get_ident()

    def listener(event, duration, **kwargs):
        if event == COMPILE_EVENT and threading.get_ident() == here:
            compiles.append(1)

    try:
        engine.warmup(all_variants=False)
        assert engine.program_warmup.num_forwards() == 1 + 4  # token bucket 16, decode buckets 1, 2, 4, 8
        jax.monitoring.register_event_duration_secs_listener(listener)
        rng = np.random.default_rng(3)
        for concurrent in range(1, 9):
            for _ in range(concurrent):
                engine.add_request(rng.integers(3, 300, 4).tolist(), SamplingParams(max_tokens=4, ignore_eos=True))
            while engine.has_unfinished_requests():
                engine.step()
        assert engine.decode_compiler.ready == [1, 2, 4, 8]
        assert {1, 2, 4, 8} <= set(engine.runner.steps_per_bucket)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        engine.close()
    assert compiles == [], f"{len(compiles)} compilations on the step path after warm-up"
