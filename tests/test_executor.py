"""GenerationExecutor: streaming, abort, n > 1, stop strings, failures, shutdown, postprocess workers, LLM front."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import signal
import time

import pytest

from jaxllm.executor import GenerationExecutor, GenerationRequest
from jaxllm.executor.detokenizer import IncrementalDetokenizer, find_stop_string, make_decoder
from jaxllm.llm import LLM
from jaxllm.sampling import SamplingParams

from conftest import tiny_engine
from server_helpers import assert_no_thread_left, live_threads

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "héllo wörld 你好"]
STAT_KEYS = {
    "timestamp",
    "iter",
    "iterLatencyMS",
    "numNewActiveRequests",
    "numActiveRequests",
    "numQueuedRequests",
    "numCompletedRequests",
    "maxNumActiveRequests",
    "gpuMemUsage",
    "maxBatchSizeRuntime",
    "maxNumTokensRuntime",
    "kvCacheStats",
    "inflightBatchingStats",
}


@pytest.fixture(scope="module")
def engine():
    """One engine for the whole module: executors come and go over it (compiling once)."""
    # One token bucket (16) and three sampler variants (greedy, sampled, sampled + logprobs) keep
    # compilation to a few programs. Context chunks come in whole KV blocks (8 tokens), so a full
    # batch of 8 decoding requests still leaves room for a chunk of a waiting prompt.
    return tiny_engine(max_seq_len=256, max_kv_tokens=4096)


def _assert_engine_clean(engine) -> None:
    stats = engine.kv_cache_manager.get_kv_cache_stats()
    assert stats.free_num_blocks == stats.max_num_blocks, stats
    assert not engine.has_unfinished_requests()


@pytest.fixture
def make_executor(engine):
    """Executors over the shared engine; each is shut down after the test and must leave nothing behind."""
    before = live_threads()
    made = []

    def make(**kwargs) -> GenerationExecutor:
        ex = GenerationExecutor(engine, **kwargs)
        made.append(ex)
        return ex

    yield make
    for ex in made:
        ex.shutdown()
    assert_no_thread_left(before)
    assert not multiprocessing.active_children()
    _assert_engine_clean(engine)


@pytest.fixture
def executor(make_executor):
    return make_executor()


def _free_blocks(ex: GenerationExecutor) -> tuple[int, int]:
    stats = ex.get_kv_cache_stats()
    return stats.free_num_blocks, stats.max_num_blocks


# ---------------------------------------------------------------------------- detokenizer
def test_incremental_detokenizer_never_splits_a_character(engine):
    tok = engine.tokenizer
    text = "héllo wörld 你好 🎉 ok"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Say:", add_special_tokens=False))
    pieces = []
    for t in ids:
        before = len(detok.text)
        detok.add([t])
        pieces.append(detok.text[before:])
    detok.flush()
    assert "".join(pieces) == detok.text == text
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # some tokens carried half a character and waited


def test_fast_decoder_matches_the_tokenizer(engine):
    tok = engine.tokenizer
    decode = make_decoder(tok)
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(0, len(tok)) for _ in range(rng.randint(1, 12))]
        for skip in (True, False):
            assert decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip)


def test_find_stop_string():
    assert find_stop_string("hello world", 5, ["wor"], False) == ("wor", 6)
    assert find_stop_string("hello world", 5, ["wor"], True) == ("wor", 9)
    assert find_stop_string("hello world", 3, ["ld"], True) == ("ld", -1)
    assert find_stop_string("hello world", 2, ["lo w"], False) is None  # fully inside old text
    assert find_stop_string("hello world", 4, ["o wo"], False) == ("o wo", 4)  # spans old and new text
    assert find_stop_string("abc", 0, ["a"], False) is None


# ---------------------------------------------------------------------------- streaming
def test_streaming_matches_non_streaming(executor):
    params = [SamplingParams(max_tokens=24), SamplingParams(max_tokens=24, temperature=0.9, seed=7)]
    for sp in params:
        plain = [executor.generate_async(p, sp) for p in PROMPTS]
        streams = [executor.generate_async(p, sp, streaming=True) for p in PROMPTS]
        for i, (want, stream) in enumerate(zip(plain, streams)):
            tokens, text, updates = [], "", 0
            for out in stream:
                updates += 1
                tokens += out.outputs[0].token_ids_diff
                text += out.outputs[0].text_diff
            want = want.result(timeout=120)
            assert updates >= (2 if i == 0 else 1)  # later streams may be done already: one merged update
            assert out.finished and stream.finished
            assert tokens == out.outputs[0].token_ids == want.outputs[0].token_ids
            assert text == out.outputs[0].text == want.outputs[0].text
            assert text == executor.tokenizer.decode(tokens, skip_special_tokens=True)
            assert out.outputs[0].finish_reason == want.outputs[0].finish_reason


def test_async_and_sync_agree(executor):
    sp = SamplingParams(max_tokens=16, temperature=0.8, seed=3, logprobs=2)
    sync = [executor.generate_async(p, sp).result(timeout=120) for p in PROMPTS]

    async def run():
        results = [executor.generate_async(p, sp, streaming=True) for p in PROMPTS]

        async def consume(r):
            last = None
            async for out in r:
                last = out
            return last

        streamed = await asyncio.gather(*(consume(r) for r in results))
        awaited = await asyncio.gather(*(executor.generate_async(p, sp).aresult(timeout=120) for p in PROMPTS))
        return streamed, awaited

    streamed, awaited = asyncio.run(run())
    for a, b, c in zip(sync, streamed, awaited):
        for other in (b, c):
            assert a.outputs[0].token_ids == other.outputs[0].token_ids
            assert a.outputs[0].text == other.outputs[0].text
            assert a.outputs[0].cumulative_logprob == pytest.approx(other.outputs[0].cumulative_logprob)
        assert len(a.outputs[0].logprobs) == len(a.outputs[0].token_ids)
        assert a.outputs[0].cumulative_logprob == pytest.approx(
            sum(lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)), rel=1e-5
        )


def test_abort_mid_stream_cancels_and_frees_blocks(executor):
    result = executor.generate_async(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True), streaming=True)
    seen = 0
    for out in result:
        seen += len(out.outputs[0].token_ids_diff)
        if seen >= 3 and not out.finished:
            result.abort()
    assert out.finished and out.outputs[0].finish_reason == "cancelled"
    assert 3 <= len(out.outputs[0].token_ids) < 200
    free, total = _free_blocks(executor)
    assert free == total
    executor.abort_request(result.request_id)  # aborting a finished request is a no-op
    executor.abort_request(12345678)


def test_timeout_finishes_with_timeout(executor):
    request = GenerationRequest(
        executor.encode(PROMPTS[1]), SamplingParams(max_tokens=240, ignore_eos=True), timeout=0.3
    )
    out = executor.submit(request).result(timeout=120)
    assert out.outputs[0].finish_reason == "timeout"
    assert len(out.outputs[0].token_ids) < 240
    assert _free_blocks(executor)[0] == _free_blocks(executor)[1]


def test_result_timeout_raises_and_request_goes_on(executor):
    result = executor.generate_async(PROMPTS[0], SamplingParams(max_tokens=64, ignore_eos=True))
    with pytest.raises(TimeoutError):
        result.result(timeout=0.001)
    assert result.result(timeout=120).outputs[0].finish_reason == "length"


# ---------------------------------------------------------------------------- n > 1, stop
def test_parallel_samples_use_distinct_seeds_and_share_the_prompt(executor):
    prompt = executor.encode("The quick brown fox jumps over the lazy dog. " * 3)
    out = executor.generate_async(prompt, SamplingParams(max_tokens=12, n=4, temperature=1.0, seed=11)).result(
        timeout=120
    )
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = executor.generate_async(prompt, SamplingParams(max_tokens=12, n=4, temperature=1.0, seed=11)).result(
        timeout=120
    )
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    stats = executor.get_kv_cache_stats()
    assert stats.reused_blocks > 0  # the samples found the prompt's full blocks in the prefix cache
    # best_of: the n best (highest cumulative logprob) of best_of samples
    best = executor.generate_async(
        prompt, SamplingParams(max_tokens=8, n=2, best_of=4, temperature=1.0, seed=5)
    ).result(timeout=120)
    assert len(best.outputs) == 2 and best.outputs[0].logprobs is None


def test_stop_strings_cut_the_text(executor):
    base = executor.generate_async(PROMPTS[2], SamplingParams(max_tokens=32, ignore_eos=True)).result(timeout=120)
    text = base.outputs[0].text
    stop = next(
        text[i : i + 2]
        for i in range(4, len(text) - 2)
        if text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2] and text.find(text[i : i + 2]) == i
    )
    cut = text.index(stop)
    for streaming in (False, True):
        out = executor.generate_async(
            PROMPTS[2], SamplingParams(max_tokens=32, ignore_eos=True, stop=[stop]), streaming=streaming
        ).result(timeout=120)
        c = out.outputs[0]
        assert c.text == text[:cut] and c.finish_reason == "stop" and c.stop_reason == stop
        assert len(c.token_ids) < 32
        out = executor.generate_async(
            PROMPTS[2],
            SamplingParams(max_tokens=32, ignore_eos=True, stop=stop, include_stop_str_in_output=True),
            streaming=streaming,
        ).result(timeout=120)
        assert out.outputs[0].text == text[: cut + len(stop)]
    # streamed diffs never show a partial stop string
    stream = executor.generate_async(
        PROMPTS[2], SamplingParams(max_tokens=32, ignore_eos=True, stop=[stop]), streaming=True
    )
    assert "".join(o.outputs[0].text_diff for o in stream) == text[:cut]
    # stop token ids: the token ends the sequence and is not part of the text
    token = base.outputs[0].token_ids[5]
    first = base.outputs[0].token_ids.index(token)
    out = executor.generate_async(
        PROMPTS[2], SamplingParams(max_tokens=32, ignore_eos=True, stop_token_ids=[token])
    ).result(timeout=120)
    c = out.outputs[0]
    assert (
        c.finish_reason == "stop" and c.stop_reason == token and c.token_ids == base.outputs[0].token_ids[: first + 1]
    )
    assert c.text == executor.tokenizer.decode(c.token_ids[:-1], skip_special_tokens=True)
    assert _free_blocks(executor)[0] == _free_blocks(executor)[1]


# ---------------------------------------------------------------------------- validation and failures
def test_bad_input_raises_value_error_and_queues_nothing(executor):
    with pytest.raises(ValueError, match="prompt"):
        executor.generate_async("", SamplingParams())
    with pytest.raises(ValueError, match="max_seq_len"):
        executor.generate_async([5] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="vocabulary"):
        executor.generate_async([10**7], SamplingParams())
    with pytest.raises(ValueError, match="logits_post_processor_name"):
        executor.generate_async("hi", SamplingParams(logits_post_processor_name="unregistered"))
    with pytest.raises(ValueError, match="best_of"):
        executor.generate_async("hi", SamplingParams(n=1, best_of=2), streaming=True)
    with pytest.raises(ValueError, match="prompt"):
        executor.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert executor.num_unfinished == 0
    assert executor.call_on_engine(lambda e: len(e.active)) == 0


def test_a_failing_request_fails_alone(executor, monkeypatch):
    """An output-processing error (here: detokenization raising) fails only its own request."""
    real_add = IncrementalDetokenizer.add

    def add(self, token_ids):
        if not self._skip_special:  # the one request below keeps special tokens
            raise RuntimeError("detokenizer exploded")
        return real_add(self, token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "add", add)
    good = [executor.generate_async(p, SamplingParams(max_tokens=40, ignore_eos=True), streaming=True) for p in PROMPTS]
    bad = executor.generate_async(
        PROMPTS[0], SamplingParams(max_tokens=40, ignore_eos=True, skip_special_tokens=False), streaming=True
    )
    with pytest.raises(RuntimeError, match="detokenizer exploded"):
        bad.result(timeout=120)
    with pytest.raises(RuntimeError, match="detokenizer exploded"):
        list(bad)
    for r in good:
        assert r.result(timeout=120).outputs[0].finish_reason == "length"
    assert executor.is_healthy
    assert _free_blocks(executor)[0] == _free_blocks(executor)[1]


def test_fatal_engine_error_fails_every_waiter(make_executor, engine):
    ex = make_executor()
    results = [ex.generate_async(p, SamplingParams(max_tokens=200, ignore_eos=True), streaming=True) for p in PROMPTS]
    next(iter(results[0]))  # running

    def boom():
        raise RuntimeError("device on fire")

    ex.call_on_engine(lambda e: setattr(e, "step", boom))
    for r in results:
        with pytest.raises(RuntimeError, match="device on fire"):
            r.result(timeout=60)
    assert not ex.is_healthy and "device on fire" in repr(ex.error)
    with pytest.raises(RuntimeError, match="shut down"):
        ex.generate_async("hi")
    ex.shutdown()
    # The engine thread is gone: put the shared engine back in order for the next tests.
    del engine.step
    for rid in list(engine.active):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def test_shutdown_cancels_requests_in_flight_and_frees_blocks(make_executor, engine):
    ex = make_executor()
    results = [
        ex.generate_async(p, SamplingParams(max_tokens=200, ignore_eos=True), streaming=s)
        for p in PROMPTS
        for s in (False, True)
    ]
    next(iter(results[1]))
    ex.shutdown()
    for r in results:
        assert r.result(timeout=5).outputs[0].finish_reason == "cancelled"
    _assert_engine_clean(engine)
    with pytest.raises(RuntimeError, match="shut down"):
        ex.generate_async("hi")
    ex.shutdown()  # idempotent


def test_random_operations_leak_nothing(executor):
    """500 random submit / abort / stream / wait operations; afterwards every block is free."""
    rng = random.Random(0)
    live = []
    for step in range(500):
        op = rng.random()
        if op < 0.45 or not live:
            params = SamplingParams(
                max_tokens=rng.randint(1, 24),
                ignore_eos=rng.random() < 0.5,
                n=rng.choice([1, 1, 1, 2]),
                temperature=rng.choice([None, 1.0]),
                seed=step,
                stop=rng.choice([None, None, "e", " t"]),
            )
            prompt = [rng.randrange(3, 400) for _ in range(rng.randint(1, 40))]
            live.append(executor.generate_async(prompt, params, streaming=rng.random() < 0.5))
        elif op < 0.7:
            live.pop(rng.randrange(len(live))).abort()
        elif op < 0.85:
            r = live.pop(rng.randrange(len(live)))
            if r.streaming:
                for _ in zip(range(rng.randint(1, 3)), r):
                    pass
                if rng.random() < 0.5:
                    r.abort()
            r.result(timeout=120)
        else:
            live.pop(rng.randrange(len(live))).result(timeout=120)
    for r in live:
        out = r.result(timeout=120)
        assert all(c.finish_reason in ("stop", "length", "cancelled") for c in out.outputs)
    assert executor.num_unfinished == 0
    assert _free_blocks(executor)[0] == _free_blocks(executor)[1]


def test_iteration_stats_have_the_reference_shape(executor):
    executor.get_stats(0)
    executor.generate(PROMPTS, SamplingParams(max_tokens=4))
    stats = executor.get_stats(timeout=5)
    assert stats and STAT_KEYS <= set(stats[-1])
    assert {
        "maxNumBlocks",
        "freeNumBlocks",
        "usedNumBlocks",
        "tokensPerBlock",
        "allocTotalBlocks",
        "allocNewBlocks",
        "reusedBlocks",
        "missedBlocks",
        "cacheHitRate",
    } <= set(stats[-1]["kvCacheStats"])
    assert {"numScheduledRequests", "numContextRequests", "numGenRequests", "numPausedRequests", "numCtxTokens"} <= set(
        stats[-1]["inflightBatchingStats"]
    )
    assert executor.get_stats(0) == []


# ---------------------------------------------------------------------------- postprocess workers
def test_postprocess_workers_give_the_same_outputs(make_executor):
    sps = [
        SamplingParams(max_tokens=20, temperature=0.8, seed=1, logprobs=1),
        SamplingParams(max_tokens=20, ignore_eos=True, stop=[" t", "e"]),
        SamplingParams(max_tokens=20, n=2, temperature=1.0, seed=2),
    ]
    local = make_executor()
    want = [
        [local.generate_async(p, sp, streaming=s).result(timeout=120) for p in PROMPTS for s in (False, True)]
        for sp in sps
    ]
    local.shutdown()
    workers = make_executor(num_postprocess_workers=2)
    assert len(multiprocessing.active_children()) == 2
    got = [
        [workers.generate_async(p, sp, streaming=s).result(timeout=120) for p in PROMPTS for s in (False, True)]
        for sp in sps
    ]
    for ws, gs in zip(want, got):
        for w, g in zip(ws, gs):
            assert [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in w.outputs] == [
                (c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in g.outputs
            ]
            assert [c.cumulative_logprob for c in w.outputs] == pytest.approx([c.cumulative_logprob for c in g.outputs])
    stream = workers.generate_async(PROMPTS[0], SamplingParams(max_tokens=100, ignore_eos=True), streaming=True)
    for out in stream:
        if len(out.outputs[0].token_ids) >= 2 and not out.finished:
            stream.abort()
    assert out.outputs[0].finish_reason == "cancelled"
    workers.shutdown()
    assert not multiprocessing.active_children()


def _semaphores() -> set[str]:
    """POSIX named semaphores (multiprocessing locks and queues create them in /dev/shm)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith("sem.")} if os.path.isdir("/dev/shm") else set()


def test_killed_postprocess_worker_fails_its_sequences_and_leaks_nothing(make_executor):
    """SIGKILL one of two workers: its sequences fail with an error, the others finish and new
    requests are served; killing the last one fails the executor cleanly. No process, fd or
    semaphore is left behind."""
    fds, sems = _num_fds(), _semaphores()
    ex = make_executor(num_postprocess_workers=2)
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    results = [ex.generate_async(p, params, streaming=True) for p in PROMPTS]
    for r in results:
        next(iter(r))  # every sequence is running and has produced output
    victim, survivor = ex.postprocess_pids
    os.kill(victim, signal.SIGKILL)
    failed, finished = [], []
    for r in results:
        try:
            finished.append(r.result(timeout=120))
        except RuntimeError as exc:
            failed.append(str(exc))
    # Sequences are pinned to workers by id (rid % 2): two on each.
    assert len(failed) == 2 and all("died" in msg and "-9" in msg for msg in failed), failed
    assert len(finished) == 2 and all(len(o.outputs[0].token_ids) == 120 for o in finished)
    assert ex.is_healthy
    assert ex.generate_async("Once upon a time", SamplingParams(max_tokens=4)).result(timeout=60).finished
    waiting = ex.generate_async("Once upon a time", params, streaming=True)
    next(iter(waiting))
    os.kill(survivor, signal.SIGKILL)  # no worker left: the executor fails, and says why
    with pytest.raises(RuntimeError, match="died"):
        waiting.result(timeout=60)
    deadline = time.monotonic() + 10
    while ex.is_healthy and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not ex.is_healthy and "every postprocess worker died" in repr(ex.error)
    ex.shutdown()
    assert not multiprocessing.active_children()
    assert _num_fds() <= fds and _semaphores() <= sems


def _num_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ---------------------------------------------------------------------------- LLM front
def test_llm_front(make_executor, engine):
    llm = LLM.from_executor(make_executor())
    with llm:
        single = llm.generate("Once upon a time", SamplingParams(max_tokens=8), use_tqdm=False)
        batch = llm.generate(PROMPTS, SamplingParams(max_tokens=8), use_tqdm=False)
        assert [o.prompt for o in batch] == PROMPTS
        assert batch[1].outputs[0].token_ids == single.outputs[0].token_ids
        ids = llm.generate([5, 6, 7], SamplingParams(max_tokens=3), use_tqdm=False)
        assert ids.prompt is None and ids.prompt_token_ids == [5, 6, 7]
        with pytest.raises(ValueError, match="prompt"):
            llm.generate(["ok", ""], use_tqdm=False)
        with pytest.raises(ValueError, match="sampling_params"):
            llm.generate(PROMPTS, [SamplingParams()], use_tqdm=False)
        assert llm.executor.num_unfinished == 0
        stream = llm.generate_async("Once upon a time", SamplingParams(max_tokens=8), streaming=True)
        assert [t for o in stream for t in o.outputs[0].token_ids_diff] == single.outputs[0].token_ids
        assert (
            asyncio.run(llm.generate_async("Once upon a time", SamplingParams(max_tokens=8)).aresult())
            .outputs[0]
            .token_ids
            == single.outputs[0].token_ids
        )
        assert STAT_KEYS <= set(llm.get_stats(timeout=2)[-1])
    with pytest.raises(RuntimeError):
        llm.generate("hi")
    with pytest.raises(RuntimeError):
        llm.generate_async("hi")
    with pytest.raises(RuntimeError):
        llm.get_stats()


def test_llm_constructor_keeps_its_contract():
    with pytest.raises(ValueError, match="not_an_option"):
        LLM("tiny-moe", not_an_option=1)
    with pytest.raises(ValueError, match="num_postprocess_workers"):
        LLM("tiny-moe", num_postprocess_workers=-1)
