"""The host KV tier (`KvCacheConfig.host_cache_size`): evicted reusable blocks wait in host
memory and are copied back on a prefix hit. Oracles: the engine with the tier off (same
greedy tokens), HF transformers (teacher forcing), and the pools' own indexes (events)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from kv_tier_workload import context_tokens, interleaved_prefixes

from jaxllm.engine.engine_config import EngineConfig
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.kv_cache.retention import KvCacheRetentionConfig, TokenRangeRetentionConfig
from jaxllm.llm_args import KvCacheConfig, parse_byte_size
from jaxllm.sampling import SamplingParams

from engine_helpers import hf_teacher_forcing_check, make_hf_model

VOCAB = 256
TPB = 8
DEVICE_TOKENS = 160  # 20 blocks: less than the 36 prefix blocks of the workload
WORKLOAD = dict(num_prefixes=6, prefix_len=48, waves=3, vocab=VOCAB)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_tier")
    return path, make_hf_model("qwen3", path, VOCAB)


def _engine(path, host: int | None, scan_layers: bool = True, **kv) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            max_batch_size=8,
            max_num_tokens=64,
            max_seq_len=128,
            scan_layers=scan_layers,
            kv_cache_config=KvCacheConfig(tokens_per_block=TPB, max_tokens=DEVICE_TOKENS, host_cache_size=host, **kv),
        )
    )


def _check(engine: LLMEngine) -> None:
    engine.kv_cache_manager.check_invariants()


def test_tier_gives_the_same_tokens_with_more_reuse_and_less_prefill_and_leaks_nothing(qwen3):
    path, hf = qwen3
    off = _engine(path, None)
    tokens_off = interleaved_prefixes(off, **WORKLOAD, step=_check)
    on = _engine(path, 4 << 20)
    kv = on.kv_cache_manager
    host = kv.host_tier
    free_device, free_host = kv.num_free_blocks, host.num_free
    tokens_on = interleaved_prefixes(on, **WORKLOAD, step=_check)
    assert tokens_on == tokens_off
    stats_off, stats_on = off.iteration_stats[-1]["kvCacheStats"], on.iteration_stats[-1]["kvCacheStats"]
    assert stats_on["reusedBlocks"] > stats_off["reusedBlocks"] + 20
    assert stats_on["onboardedBlocks"] > 20 and stats_on["offloadedBlocks"] >= stats_on["onboardedBlocks"]
    assert stats_on["onboardedBytes"] == stats_on["onboardedBlocks"] * host.bytes_per_block
    assert context_tokens(on) < context_tokens(off) * 0.6
    # Nothing leaks: every device block is free or cached, every host slot free or cached.
    assert kv.num_free_blocks == free_device == kv.num_blocks
    assert host.num_pending == 0 and host.num_free + host.num_cached == free_host
    kv.check_invariants()
    # HF agrees with the tokens of the last wave (all of whose prefixes came back from the host).
    import numpy as np

    rng = np.random.default_rng(0)
    prefixes = [[int(t) for t in rng.integers(3, VOCAB, 48)] for _ in range(6)]
    for i in (0, 3, 5):
        hf_teacher_forcing_check(hf, prefixes[i] + [5, 3 + i], tokens_on[12 + i])


def test_events_replay_both_tiers_under_eviction_with_retention_priorities(qwen3):
    path, _ = qwen3
    from jaxllm.models import load_model_config

    config = load_model_config(path, "float32")
    block = config.num_layers * 2 * config.num_kv_heads * config.head_dim * TPB * 4  # keys and values, f32
    engine = LLMEngine(
        EngineConfig(
            model=str(path),
            dtype="float32",
            max_batch_size=4,
            max_num_tokens=64,
            max_seq_len=128,
            kv_cache_config=KvCacheConfig(
                tokens_per_block=TPB,
                max_tokens=96,
                host_cache_size=10 * block + block // 2,
                event_buffer_max_size=100_000,
                secondary_offload_min_priority=30,
            ),
        )
    )
    kv = engine.kv_cache_manager
    host = kv.host_tier
    assert host.num_slots == 10 and host.bytes_per_block == block
    events = engine.get_kv_cache_events()
    assert events[0]["data"] == {"type": "created", "num_blocks_per_cache_level": [12, 10]}
    live: dict = {}  # block hash -> (parent, tokens, priority, cache level)
    levels_seen = set()

    def replay_and_compare(engine) -> None:
        for event in engine.get_kv_cache_events():
            data = event["data"]
            if data["type"] == "stored":
                parent = data["parent_hash"]
                for block in data["blocks"]:
                    assert block["block_hash"] not in live
                    tokens = tuple(t["token_id"] for t in block["tokens"])
                    live[block["block_hash"]] = (parent, tokens, block["priority"], block["cache_level"])
                    parent = block["block_hash"]
            elif data["type"] == "removed":
                for h in data["block_hashes"]:
                    del live[h]
            elif data["type"] == "updated":
                parent, tokens, priority, level = live[data["block_hash"]]
                if data["cache_level"] is not None:
                    assert data["cache_level"]["old_value"] == level
                    level = data["cache_level"]["new_value"]
                    levels_seen.add((data["cache_level"]["old_value"], level))
                if data["priority"] is not None:
                    assert data["priority"]["old_value"] == priority
                    priority = data["priority"]["new_value"]
                live[data["block_hash"]] = (parent, tokens, priority, level)
        device = {h: v[:3] for h, v in live.items() if v[3] == 0}
        on_host = {h: v[:3] for h, v in live.items() if v[3] == 1}
        assert device == kv.block_pool.cached_prefixes()
        assert on_host == host.cached_prefixes()
        kv.check_invariants()

    import numpy as np

    rng = np.random.default_rng(1)
    prefixes = [[int(t) for t in rng.integers(3, VOCAB, 32)] for _ in range(5)]
    low = KvCacheRetentionConfig([TokenRangeRetentionConfig(0, None, 10)])  # below the offload minimum
    high = KvCacheRetentionConfig([TokenRangeRetentionConfig(0, 16, 90)])
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for wave in range(4):
        for i, p in enumerate(prefixes):
            config = low if i == 4 else high if i == 0 else None
            engine.add_request(p + [3 + wave], params, kv_cache_retention_config=config)
        while engine.has_unfinished_requests():
            engine.step()
            replay_and_compare(engine)
    assert {(0, 1), (1, 0)} <= levels_seen
    assert host.dropped_blocks > 0 and kv.block_pool.num_evictions > 0
    # A low-priority prefix is never offloaded.
    low_first = tuple(prefixes[4][:TPB])
    assert all(tokens != low_first for _, tokens, _ in host.cached_prefixes().values())
    assert {p for _, _, p in host.cached_prefixes().values()} >= {35}


def test_byte_sizes_and_bad_configuration_are_refused_with_the_field_named(qwen3):
    path, _ = qwen3
    assert parse_byte_size("x", "8GiB") == 8 * 2**30
    assert parse_byte_size("x", "512MB") == 512 * 10**6
    assert parse_byte_size("x", 4096) == 4096
    with pytest.raises(ValueError, match="host_cache_size must be a byte count"):
        KvCacheConfig(host_cache_size="lots")
    with pytest.raises(ValueError, match="host_cache_size=.* more than this machine's memory"):
        KvCacheConfig(host_cache_size=1 << 60)
    with pytest.raises(ValueError, match="secondary_offload_min_priority"):
        KvCacheConfig(secondary_offload_min_priority=101)
    with pytest.raises(ValueError, match=r"host_cache_size=100 bytes is smaller than one KV block \(\d+ bytes\)"):
        _engine(path, 100)
    with pytest.raises(ValueError, match="host_cache_size needs enable_block_reuse"):
        _engine(path, 1 << 20, enable_block_reuse=False)


@pytest.mark.parametrize(
    "size, message",
    [
        ("8 lots", "host_cache_size must be a byte count such as 8GiB or 512MB, got '8 lots'"),
        ("100", r"kv_cache_config.host_cache_size=100 bytes is smaller than one KV block \(\d+ bytes\)"),
    ],
)
def test_cli_refuses_a_bad_host_size_in_one_line(size, message):
    """A size that is not one (refused with the flags) or holds no block (refused when the
    engine is built): one line, exit status 2."""
    import os
    import re

    proc = subprocess.run(
        [sys.executable, "-m", "jaxllm", "serve", "--model", "tiny-moe", "--kv-cache-host-size", size, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])),
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert re.fullmatch("jaxllm serve: error: " + message, lines[-1]), lines[-3:]


def test_cli_flag_and_config_file_reach_the_kv_cache_config(tmp_path):
    from jaxllm.cli import build_parser
    from jaxllm.cli.args import engine_kwargs

    args = build_parser().parse_args(["generate", "--kv-cache-host-size", "1GiB"])
    assert engine_kwargs(args)["kv_cache_config"].host_cache_size == 2**30
    config = tmp_path / "llm.yaml"
    config.write_text("kv_cache_config:\n  host_cache_size: 256MB\n  secondary_offload_min_priority: 50\n")
    kv = engine_kwargs(build_parser().parse_args(["generate", "--config", str(config)]))["kv_cache_config"]
    assert (kv.host_cache_size, kv.secondary_offload_min_priority) == (256 * 10**6, 50)
    assert engine_kwargs(build_parser().parse_args(["generate"]))["kv_cache_config"].host_cache_size is None


def test_eviction_order_across_tiers_with_priorities():
    """The device evicts lowest priority first; blocks under the offload minimum are dropped;
    a full host evicts its own lowest priority, oldest first; a slot reused within one batch is
    written by its last offload only; a prefix already on the host is not offloaded twice."""
    from jaxllm.kv_cache.block_pool import ROOT_NODE, BlockPool
    from jaxllm.kv_cache.host_tier import HostTier

    pool = BlockPool(4)
    host = HostTier(2, 100, min_priority=20)
    pool.offload = host.offload
    blocks = pool.allocate_many(4)
    nodes = [pool.register(b, ROOT_NODE, (b,), priority) for b, priority in zip(blocks, (10, 50, 35, 35))]
    for b in blocks:
        pool.release(b)
    pool.allocate()  # evicts priority 10: below the minimum, dropped
    assert host.num_cached == 0 and host.dropped_blocks == 1
    pool.allocate()  # priority 35, released first: offloaded
    pool.allocate()  # the other 35: offloaded, the host is full
    assert set(host.cached_prefixes()) == {nodes[2], nodes[3]}
    pool.allocate()  # priority 50: offloaded over the host's oldest lowest-priority block
    assert host.cached_prefixes() == {nodes[3]: (None, (blocks[3],), 35), nodes[1]: (None, (blocks[1],), 50)}
    offloads, onboards = host.take_transfers()
    assert sorted(offloads) == sorted(
        [(blocks[3], host.lookup(ROOT_NODE, (blocks[3],))), (blocks[1], host.lookup(ROOT_NODE, (blocks[1],)))]
    )
    assert onboards == []
    host.check_invariants()
    # The same prefix computed again on the device, then evicted: the host keeps its copy.
    pool2 = BlockPool(1)
    pool2.offload = host.offload
    block = pool2.allocate()
    pool2.register(block, ROOT_NODE, (blocks[3],), 35)
    pool2.release(block)
    pool2.allocate()
    assert host.num_cached == 2 and host.num_pending == 0
    host.check_invariants()


def test_a_block_evicted_before_its_onboarding_copy_ran_is_dropped_not_offloaded():
    """Onboarding queues a host -> device copy made before the next step; if the block is freed
    and evicted before that, its device bytes were never written: it must not go back to the host."""
    from jaxllm.kv_cache.block_pool import ROOT_NODE, BlockPool
    from jaxllm.kv_cache.events import KvCacheEventBuffer, KvEventRecorder
    from jaxllm.kv_cache.host_tier import HostTier, match_and_onboard
    from jaxllm.llm_request import LlmRequest

    buffer = KvCacheEventBuffer(100, window_size=64)
    events = KvEventRecorder(buffer)
    pool = BlockPool(2, events=events, num_secondary_blocks=2)
    host = HostTier(2, 1, events=events)
    pool.offload = host.offload
    block = pool.allocate()
    node = pool.register(block, ROOT_NODE, (1, 2, 3, 4))
    pool.release(block)
    owned = pool.allocate_many(2)  # evicts the cached block: offloaded
    assert host.take_transfers() == ([(block, 0)], [])
    for b in owned:
        pool.release(b)
    matched = match_and_onboard(pool, host, LlmRequest(1, [1, 2, 3, 4, 5], 1), 4, 8)
    assert len(matched) == 1 and pool.node_of(matched[0]) == node and host.num_cached == 0
    pool.release(matched[0])
    pool.allocate_many(2)  # evicts it again before the onboarding copy ran
    assert host.take_transfers() == ([], []) and host.num_cached == 0
    host.check_invariants()
    kinds = [(e["data"]["type"], e["data"].get("cache_level")) for e in buffer.get()]
    assert kinds == [
        ("created", None),
        ("updated", {"type": "event_diff", "old_value": 0, "new_value": 1}),
        ("updated", {"type": "event_diff", "old_value": 1, "new_value": 0}),
        ("removed", None),
    ]


@pytest.mark.parametrize("memory", ["host_memory_kind", "copy_to_host_async"])
@pytest.mark.parametrize("layout", ["pool", "per_layer", "mla"])
def test_copies_bring_back_the_exact_bytes_of_every_layer(layout, memory):
    """Offload blocks of a cache whose every element is distinct, reuse a host slot across
    batches, then onboard into other device blocks: each comes back bit for bit, every layer,
    through the backend's pinned host memory (the CPU backend has it) or without a memory kind."""
    import types

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxllm.engine.kv_offload import KvOffloader, block_bytes
    from jaxllm.kv_cache.host_tier import HostTier
    from jaxllm.kv_cache.spec import MhaLayerCache, MlaLayerCache

    num_blocks, layers = 6, 3

    def values(shape, seed):
        return jnp.asarray(np.arange(np.prod(shape), dtype=np.float32).reshape(shape) + seed * 1e6)

    if layout == "pool":  # [heads, layers * blocks, tokens, dim]
        cache = MhaLayerCache(values((2, layers * num_blocks, 4, 8), 1), values((2, layers * num_blocks, 4, 8), 2))
    elif layout == "per_layer":
        cache = [
            MhaLayerCache(values((2, num_blocks, 4, 8), 2 * i), values((2, num_blocks, 4, 8), 2 * i + 1))
            for i in range(layers)
        ]
    else:  # [layers * blocks, tokens, latent]
        cache = MlaLayerCache(values((layers * num_blocks, 4, 24), 7))
    runner = types.SimpleNamespace(kv_cache=cache)
    original = [np.asarray(a) for a in jax_leaves(cache)]
    tier = HostTier(2, block_bytes(cache, num_blocks))
    offloader = KvOffloader(runner, [tier], num_blocks)
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    assert offloader.memory_kind == ("pinned_host" if "pinned_host" in kinds else "unpinned_host")
    if memory == "copy_to_host_async":
        offloader.copier.memory_kind = None
    assert tier.offload(1, (0, (1,)), 101, 35) and tier.offload(2, (0, (2,)), 102, 35)
    offloader.flush()
    assert tier.offload(4, (0, (4,)), 104, 35)  # the host is full: block 1's slot now holds block 4
    offloader.flush()
    for block, target in ((2, 0), (4, 5)):
        slot = tier.lookup(0, (block,))
        tier.take(slot)
        tier.queue_onboard(slot, target, 100 + block)
    offloader.flush()
    offloader.poll(wait=True)
    restored = [np.asarray(a) for a in jax_leaves(runner.kv_cache)]
    for before, after in zip(original, restored):
        per_layer = before.shape[-3] // num_blocks if before.ndim == 3 else before.shape[1] // num_blocks
        for layer in range(per_layer):
            for src, dst in ((2, 0), (4, 5)):
                s, d = layer * num_blocks + src, layer * num_blocks + dst
                if before.ndim == 3:
                    assert np.array_equal(after[d], before[s])
                else:
                    assert np.array_equal(after[:, d], before[:, s])
        untouched = [b for b in range(num_blocks) if b not in (0, 5)]
        for layer in range(per_layer):
            idx = [layer * num_blocks + b for b in untouched]
            assert np.array_equal(np.take(after, idx, axis=after.ndim - 3), np.take(before, idx, axis=before.ndim - 3))
    assert offloader.counts.onboarded_blocks == 2 and offloader.counts.offloaded_blocks == 3


def jax_leaves(cache):
    import jax

    return jax.tree_util.tree_leaves(cache)


def test_retention_durations_run_out_on_the_host_too():
    """A block offloaded with a high priority and a duration keeps both on the host; once the
    duration ran out it has the default priority there (an `updated` event) and is evicted
    before a lower but lasting priority. Onboarded in time, it takes the rest of its duration
    back to the device."""
    from jaxllm.kv_cache.block_pool import ROOT_NODE, BlockPool
    from jaxllm.kv_cache.events import KvCacheEventBuffer, KvEventRecorder
    from jaxllm.kv_cache.host_tier import HostTier, match_and_onboard
    from jaxllm.llm_request import LlmRequest

    now = [0.0]
    buffer = KvCacheEventBuffer(100, window_size=64)
    events = KvEventRecorder(buffer)
    pool = BlockPool(3, events=events, clock=lambda: now[0], num_secondary_blocks=2)
    host = HostTier(2, 1, events=events, clock=lambda: now[0])
    pool.offload = host.offload
    blocks = pool.allocate_many(3)
    nodes = [pool.register(b, ROOT_NODE, (b,), 35) for b in blocks]
    pool.set_retention(blocks[0], 80, 10.0)  # 80 for 10 s after release
    pool.set_retention(blocks[1], 50, None)  # 50 for good
    pool.set_retention(blocks[2], 60, 100.0)
    for b in blocks:
        pool.release(b)
    pool.allocate_many(2)  # evicts 50 and 60 (with 100 s left) to the host
    assert host.cached_prefixes() == {nodes[1]: (None, (1,), 50), nodes[2]: (None, (2,), 60)}
    now[0] = 5.0
    pool.allocate()  # evicts 80 (5 s left): the host drops 50, its lowest
    assert host.cached_prefixes() == {nodes[2]: (None, (2,), 60), nodes[0]: (None, (0,), 80)}
    now[0] = 11.0  # the 80's duration ran out on the host: it is evicted before the 60
    assert host.offload(9, (ROOT_NODE, (9,)), 999, 40)
    assert host.cached_prefixes() == {nodes[2]: (None, (2,), 60), 999: (None, (9,), 40)}
    updates = [e["data"] for e in buffer.get() if e["data"]["type"] == "updated" and e["data"]["priority"]]
    assert updates[-1]["block_hash"] == nodes[0] and updates[-1]["priority"]["new_value"] == 35
    host.take_transfers()
    # Onboarded 50 s later, the 60 keeps its last 50 s: counted again once it is released.
    now[0] = 50.0
    for b in range(3):
        if pool.ref_count[b]:
            pool.release(b)
    expiries = pool.num_pending_expiries
    (block,) = match_and_onboard(pool, host, LlmRequest(1, [2, 0], 1), 1, 4)
    assert pool.node_of(block) == nodes[2] and pool.priority[block] == 60
    pool.release(block)
    assert pool.num_pending_expiries == expiries + 1
    host.check_invariants()
