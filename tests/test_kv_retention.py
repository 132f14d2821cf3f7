"""KV cache retention priorities (eviction order, durations) and KV cache events.

Most checks run on the KV manager alone; one engine run checks that retention changes no
token and that the events reach `LLM.get_kv_cache_events`."""

from __future__ import annotations

import datetime
import threading

import pytest
from kv_event_replay import replay as _replay

from jaxllm import KvCacheRetentionConfig, TokenRangeRetentionConfig
from jaxllm.kv_cache import KvCacheEventBuffer, KVCacheManager, KvEventRecorder
from jaxllm.llm_request import LlmRequest
from jaxllm.lora import LoraAdapter, LoRARequest
from jaxllm.scheduler import (
    GuaranteedNoEvictScheduler,
    MaxUtilizationScheduler,
    MicroBatchScheduler,
    SchedulerOutput,
    SimpleScheduler,
)

from scheduler_fakes import FakeExecutor

TPB = 4


def _prompt(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def _retain(priority: int, duration_ms=None, start: int = 0, end=None) -> KvCacheRetentionConfig:
    return KvCacheRetentionConfig([TokenRangeRetentionConfig(start, end, priority, duration_ms)])


def _serve(kv: KVCacheManager, req: LlmRequest, generate: int = 0) -> None:
    """Run the whole prompt of `req`, then `generate` decode steps, then finish and free it."""
    kv.add_sequence(req)
    req.context_chunk_size = req.context_remaining_length
    kv.prepare_resources(SchedulerOutput([req], [], []))
    assert req.move_to_next_context_chunk()
    req.add_new_token(7)
    for _ in range(generate):
        kv.prepare_resources(SchedulerOutput([], [req], []))
        req.add_new_token(8)
    req.finish("stop")
    kv.free_resources(req)


def _reused_tokens(kv: KVCacheManager, prompt: list[int], rid: int = 99) -> int:
    probe = LlmRequest(rid, prompt, 1)
    reused = kv.add_sequence(probe)
    probe.finish("cancelled")
    kv.free_resources(probe)
    return reused


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ----------------------------------------------------------------------------- config
def test_per_block_priorities_follow_the_reference():
    """TensorRT-LLM's own KvCacheRetentionConfig unit test cases: a block takes the range
    holding its first token, uncovered blocks none (the default)."""
    config = KvCacheRetentionConfig([TokenRangeRetentionConfig(0, 64, 80), TokenRangeRetentionConfig(64, 128, 50)], 30)
    assert config.per_block_priorities(64, 256) == [80, 50, None, None]
    config = KvCacheRetentionConfig([TokenRangeRetentionConfig(0, 63, 80), TokenRangeRetentionConfig(63, 127, 30)], 30)
    assert config.per_block_priorities(32, 127) == [80, 80, 30, 30]
    config = KvCacheRetentionConfig([TokenRangeRetentionConfig(0, 1, 80), TokenRangeRetentionConfig(1, 2, 5)], 30)
    assert config.per_block_priorities(32, 128) == [80, None, None, None]
    # unsorted ranges are sorted; a block past the prompt takes the decode settings
    config = KvCacheRetentionConfig(
        [TokenRangeRetentionConfig(8, None, 60), TokenRangeRetentionConfig(0, 4, 90)],
        decode_retention_priority=10,
        decode_duration_ms=datetime.timedelta(seconds=2),
    )
    assert config.per_block_priorities(4, 16) == [90, None, 60, 60]
    assert config.block_retention(4, 4, prompt_len=16) == (10, 2.0)
    assert KvCacheRetentionConfig(max_tokens=8).per_block_priorities(4, 16) == [100, 100, None, None]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: TokenRangeRetentionConfig(0, 8, 101), r"priority must be in \[0, 100\], got 101"),
        (lambda: TokenRangeRetentionConfig(0, 8, -1), r"priority must be in \[0, 100\]"),
        (lambda: TokenRangeRetentionConfig(0, 8, 50.5), r"priority must be an int"),
        (lambda: TokenRangeRetentionConfig(8, 8, 50), r"token range \[8, 8\) is empty"),
        (lambda: TokenRangeRetentionConfig(-1, 8, 50), r"token_start must be a non-negative int"),
        (lambda: TokenRangeRetentionConfig(0, 8, 50, duration_ms=0), r"duration_ms must be a positive duration"),
        (lambda: TokenRangeRetentionConfig(0, 8, 50, duration_ms="1s"), r"duration_ms must be milliseconds"),
        (
            lambda: KvCacheRetentionConfig(
                [TokenRangeRetentionConfig(0, 64, 80), TokenRangeRetentionConfig(30, 128, 80)]
            ),
            r"token ranges must not overlap: \[0, 64\) and \[30, 128\)",
        ),
        (
            lambda: KvCacheRetentionConfig(
                [TokenRangeRetentionConfig(0, None, 80), TokenRangeRetentionConfig(64, 70, 8)]
            ),
            r"only the last token range may have token_end=None",
        ),
        (lambda: KvCacheRetentionConfig([], decode_retention_priority=200), r"decode_retention_priority must be in"),
        (lambda: KvCacheRetentionConfig([], decode_duration_ms=-5), r"decode_duration_ms must be a positive duration"),
        (lambda: KvCacheRetentionConfig(TokenRangeRetentionConfig(0, 8, 50)), r"must be a list of TokenRangeRetention"),
        (lambda: KvCacheRetentionConfig([(0, 8, 50)]), r"must hold TokenRangeRetentionConfig entries, got tuple"),
        (lambda: KvCacheRetentionConfig([TokenRangeRetentionConfig(0, 8, 50)], max_tokens=8), r"either max_tokens"),
    ],
)
def test_invalid_configs_raise_clear_errors(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# ----------------------------------------------------------------------------- eviction
@pytest.mark.parametrize("with_retention", [False, True])
def test_priority_decides_what_is_evicted(with_retention):
    """Two cached prefixes, one block of room too few: plain LRU evicts the older one; with
    retention the high-priority prefix survives although it is older."""
    kv = KVCacheManager(num_blocks=6, tokens_per_block=TPB, max_blocks_per_seq=8)
    high_prompt, low_prompt = _prompt(100, 9), _prompt(200, 9)  # 2 full blocks each stay cached
    _serve(kv, LlmRequest(1, high_prompt, 1, kv_cache_retention_config=_retain(90) if with_retention else None))
    _serve(kv, LlmRequest(2, low_prompt, 1, kv_cache_retention_config=_retain(10) if with_retention else None))
    assert kv.num_cached_blocks == 4
    if with_retention:
        assert sorted(p for _, _, p in kv.block_pool.cached_prefixes().values()) == [10, 10, 90, 90]
    pressure = LlmRequest(3, _prompt(300, 13), 1)  # 4 blocks: the 2 free ones and 2 evicted
    kv.add_sequence(pressure)
    kv.allocate_to_completion(pressure)
    kv.check_invariants()
    pressure.finish("cancelled")
    kv.free_resources(pressure)
    survivor, evicted = (high_prompt, low_prompt) if with_retention else (low_prompt, high_prompt)
    assert _reused_tokens(kv, survivor) == 2 * TPB
    assert _reused_tokens(kv, evicted) == 0
    kv.check_invariants()


@pytest.mark.parametrize("elapsed, high_survives", [(0.5, True), (2.0, False)])
def test_expired_duration_reverts_to_the_default_priority(elapsed, high_survives):
    """Priority 90 for 1 s after release, against a prefix kept at 50: within the second the
    50 prefix is evicted; after it the first prefix is back at the default 35 and goes first."""
    clock = _Clock()
    buffer = KvCacheEventBuffer(100, window_size=32)
    kv = KVCacheManager(
        num_blocks=6, tokens_per_block=TPB, max_blocks_per_seq=8, clock=clock, events=KvEventRecorder(buffer)
    )
    high_prompt, mid_prompt = _prompt(100, 9), _prompt(200, 9)
    _serve(kv, LlmRequest(1, high_prompt, 1, kv_cache_retention_config=_retain(90, duration_ms=1000)))
    for rid in range(10, 30):  # reused and released again (restarting the duration) many times
        clock.now += 0.01
        _serve(kv, LlmRequest(rid, high_prompt, 1))
    assert kv.block_pool.num_pending_expiries <= 2 * kv.num_blocks  # stale expiries do not pile up
    _serve(kv, LlmRequest(2, mid_prompt, 1, kv_cache_retention_config=_retain(50)))
    buffer.get()
    clock.now += elapsed
    pressure = LlmRequest(3, _prompt(300, 13), 1)
    kv.add_sequence(pressure)
    kv.allocate_to_completion(pressure)
    events = [e["data"] for e in buffer.get()]
    updates = [(e["priority"]["old_value"], e["priority"]["new_value"]) for e in events if e["type"] == "updated"]
    assert updates == ([] if high_survives else [(90, 35)] * 2)
    assert sorted(p for _, _, p in kv.block_pool.cached_prefixes().values()) == (
        [90, 90] if high_survives else [50, 50]
    )
    pressure.finish("cancelled")
    kv.free_resources(pressure)
    assert (_reused_tokens(kv, high_prompt) == 2 * TPB) == high_survives
    assert (_reused_tokens(kv, mid_prompt) == 2 * TPB) != high_survives
    kv.check_invariants()


def test_reuse_and_decode_blocks_take_the_requests_priorities():
    buffer = KvCacheEventBuffer(100, window_size=64)
    kv = KVCacheManager(num_blocks=16, tokens_per_block=TPB, max_blocks_per_seq=8, events=KvEventRecorder(buffer))
    prompt = _prompt(100, 9)
    _serve(kv, LlmRequest(1, prompt, 10))  # default priority everywhere
    buffer.get()
    # Reused with a config: the reused blocks take its priorities (an `updated` event each);
    # the generated blocks take the decode priority.
    config = KvCacheRetentionConfig([TokenRangeRetentionConfig(0, 4, 70)], decode_retention_priority=5)
    req = LlmRequest(2, prompt, 10, kv_cache_retention_config=config)
    _serve(kv, req, generate=8)
    events = [e["data"] for e in buffer.get()]
    updated = [e for e in events if e["type"] == "updated"]
    assert len(updated) == 1 and updated[0]["priority"] == {"type": "event_diff", "old_value": 35, "new_value": 70}
    prefixes = kv.block_pool.cached_prefixes()
    by_tokens = {tokens: priority for _, tokens, priority in prefixes.values()}
    assert by_tokens[tuple(prompt[:4])] == 70 and by_tokens[tuple(prompt[4:8])] == 35  # second block: no range
    tokens = req.all_token_ids
    # block 2 holds prompt token 8 (a prompt block, no range: default), blocks 3.. generated tokens only
    assert by_tokens[tuple(tokens[8:12])] == 35
    assert by_tokens[tuple(tokens[12:16])] == 5
    stored = [b for e in events if e["type"] == "stored" for b in e["blocks"]]
    assert {tuple(t["token_id"] for t in b["tokens"]): b["priority"] for b in stored} == {
        tuple(tokens[8:12]): 35,
        tuple(tokens[12:16]): 5,
    }
    kv.check_invariants()


# ----------------------------------------------------------------------------- events
@pytest.mark.parametrize("policy", ["no_evict", "max_utilization"])
def test_events_report_exactly_the_blocks_stored_and_removed(policy):
    """A workload of shared and private prefixes, some with retention configs, on a pool too
    small for all of them (evictions; pauses under MAX_UTILIZATION): after every step the
    replayed events equal the pool's own prefix index, block for block."""
    buffer = KvCacheEventBuffer(10_000, window_size=64)
    kv = KVCacheManager(num_blocks=24, tokens_per_block=TPB, max_blocks_per_seq=16, events=KvEventRecorder(buffer))
    capacity = GuaranteedNoEvictScheduler(4, kv) if policy == "no_evict" else MaxUtilizationScheduler(4, kv)
    ex = FakeExecutor(SimpleScheduler(capacity, MicroBatchScheduler(4, 16)), kv, 4, 16)
    first = buffer.get()
    assert [e["data"] for e in first] == [{"type": "created", "num_blocks_per_cache_level": [24]}]
    live: dict = {}
    lora_ids: dict = {}
    stored_ever: dict = {}
    configs = [None, _retain(80), _retain(20, duration_ms=1), KvCacheRetentionConfig(decode_retention_priority=60)]
    # Requests with a LoRA adapter have their own prefix tree; their stored blocks name it.
    adapter = LoraAdapter(LoRARequest("a", 3, "/unused"), rank=1, scaling=1.0, weights={})
    shared = _prompt(5000, 10)
    for wave in range(3):
        reqs = []
        for i in range(6):
            rid = wave * 10 + i + 1
            prompt = shared + _prompt(rid * 100, 3 + i) if i % 2 else _prompt(rid * 100, 5 + 2 * i)
            req = LlmRequest(
                rid, prompt, 6 + i, arrival_time=float(rid), kv_cache_retention_config=configs[(rid + wave) % 4]
            )
            req.lora_adapter = adapter if i in (3, 4) else None
            reqs.append(req)
        ex.add(*reqs)
        while ex.active:
            ex.step()
            _replay(buffer.get(), live, lora_ids)
            stored_ever.update(live)
            assert live == kv.block_pool.cached_prefixes()
    assert kv.block_pool.num_evictions > 0  # the pool was under pressure
    assert {p for _, _, p in live.values()} >= {35, 80}
    # the shared first block was cached once per prefix tree: base model and adapter 3
    assert sorted(
        map(
            str,
            (
                lora_ids[h]
                for h, (parent, tokens, _) in stored_ever.items()
                if parent is None and tokens == tuple(shared[:4])
            ),
        )
    ) == ["3", "None"]
    ids = [e["event_id"] for e in first]
    assert ids == [0]


def test_event_buffer_is_bounded_and_thread_safe():
    buffer = KvCacheEventBuffer(3, window_size=8)
    recorder = KvEventRecorder(buffer, rank=1)
    for i in range(5):
        recorder.removed([i])
    events = buffer.get()
    assert [e["data"]["block_hashes"] for e in events] == [[2], [3], [4]] and buffer.num_dropped == 2
    assert all(e["attention_dp_rank"] == 1 and e["window_size"] == 8 for e in events)
    assert buffer.get() == []
    got = []
    waiter = threading.Thread(target=lambda: got.extend(buffer.get(timeout=10.0)))
    waiter.start()
    recorder.removed([9])
    waiter.join(10.0)
    assert [e["data"]["block_hashes"] for e in got] == [[9]] and got[0]["event_id"] == 5
    with pytest.raises(ValueError, match="event_buffer_max_size"):
        KvCacheEventBuffer(0, window_size=8)


def test_no_event_buffer_records_nothing():
    kv = KVCacheManager(num_blocks=8, tokens_per_block=TPB, max_blocks_per_seq=8)
    assert kv.block_pool.events is None
    _serve(kv, LlmRequest(1, _prompt(1, 9), 1, kv_cache_retention_config=_retain(50)))
    assert kv.num_cached_blocks == 2


# ----------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def llm():
    from jaxllm import LLM, KvCacheConfig

    # 24 blocks of 8 tokens: the three waves below do not fit at once, so cached prefixes are evicted.
    llm = LLM(
        "tiny-dense",
        max_batch_size=4,
        max_num_tokens=16,
        max_seq_len=64,
        kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=192, event_buffer_max_size=1000),
        warmup="none",  # the tests compile what their steps need
    )
    yield llm
    llm.shutdown()


def test_engine_same_tokens_with_retention_and_events_match_the_pool(llm):
    from jaxllm import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    system = _prompt(20, 16)  # two shared blocks
    prompts = [system + _prompt(40 + 10 * i, 5 + i) for i in range(4)] + [_prompt(100 + 20 * i, 19) for i in range(4)]
    events = llm.get_kv_cache_events(timeout=0)
    assert [e["data"] for e in events] == [{"type": "created", "num_blocks_per_cache_level": [24]}]
    live: dict = {}
    _replay(events[1:], live)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    keep_system = KvCacheRetentionConfig([TokenRangeRetentionConfig(0, 16, 90)], decode_retention_priority=10)
    retained = [
        o.outputs[0].token_ids
        for o in llm.generate(prompts, params, use_tqdm=False, kv_cache_retention_config=keep_system)
    ]
    # A third wave of unrelated prompts evicts; the high-priority system prompt stays cached.
    llm.generate([_prompt(200 + 20 * i, 19) for i in range(4)], params, use_tqdm=False)
    assert retained == plain
    _replay(llm.get_kv_cache_events(timeout=0), live)
    pool = llm.executor.call_on_engine(lambda engine: engine.kv_cache_manager.block_pool.cached_prefixes())
    assert live == pool
    by_tokens = {tokens: priority for _, tokens, priority in pool.values()}
    assert by_tokens[tuple(system[:8])] == 90 and by_tokens[tuple(system[8:])] == 90
    assert llm.executor.call_on_engine(lambda engine: engine.kv_cache_manager.block_pool.num_evictions) > 0
    with pytest.raises(ValueError, match="kv_cache_retention_config must be a KvCacheRetentionConfig"):
        llm.generate(prompts[0], params, kv_cache_retention_config={"priority": 90})
    with pytest.raises(ValueError, match="kv_cache_retention_config has 1 entries for 2 prompts"):
        llm.generate(prompts[:2], params, kv_cache_retention_config=[keep_system])


def test_server_takes_a_retention_config_and_serves_events(llm):
    import httpx

    from jaxllm.server.app import build_app
    from jaxllm.server.server_config import ServerConfig

    from server_helpers import LiveServer

    server = LiveServer(build_app(llm.executor, ServerConfig(served_model_name="tiny", api_key="k")))
    auth = {"Authorization": "Bearer k"}
    try:
        llm.get_kv_cache_events(timeout=0)
        prompt = _prompt(300, 17)
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 2,
            "temperature": 0,
            "kv_cache_retention_config": {
                "token_range_retention_priorities": [{"token_start": 0, "token_end": 8, "priority": 77}]
            },
        }
        reply = httpx.post(server.url + "/v1/completions", json=body, headers=auth, timeout=60)
        assert reply.status_code == 200, reply.text
        assert httpx.post(server.url + "/kv_cache_events", timeout=60).status_code == 401  # events show prompts
        events = httpx.post(server.url + "/kv_cache_events", headers=auth, timeout=60).json()
        stored = {
            tuple(t["token_id"] for t in b["tokens"]): b["priority"]
            for e in events
            if e["data"]["type"] == "stored"
            for b in e["data"]["blocks"]
        }
        assert stored[tuple(prompt[:8])] == 77 and stored[tuple(prompt[8:16])] == 35
        assert httpx.post(server.url + "/kv_cache_events", headers=auth, timeout=60).json() == []  # drained
        body["kv_cache_retention_config"]["token_range_retention_priorities"][0]["priority"] = 101
        reply = httpx.post(server.url + "/v1/completions", json=body, headers=auth, timeout=60)
        assert reply.status_code == 400
        assert reply.json()["error"]["param"] == "kv_cache_retention_config"
        assert "priority must be in [0, 100], got 101" in reply.json()["error"]["message"]
    finally:
        server.stop()
