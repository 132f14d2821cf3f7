"""The engine's side of disaggregated serving, in one process: a context engine holds a
context-only request's blocks, a generation engine takes them over and decodes. The tokens
must equal the same request run whole on one engine (the engine without the feature), for a
dense (GQA) model and an MLA (DeepSeek-V3) model, with no prompt token computed again on the
generation side; and the blocks must matter (zeroed blocks give other tokens). Config
checks: one clear error per bad field."""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm.engine.kv_transceiver import KvPayload
from jaxllm.llm_args import CacheTransceiverConfig, DisaggregatedParams
from jaxllm.sampling import SamplingParams

from conftest import tiny_engine

PROMPTS = [list(range(5, 40)), [7, 8, 9] * 11, list(range(60, 69))]


def _run(engine) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for update in engine.step():
            assert update.error is None, update.error
            out.setdefault(update.request.request_id, []).extend(update.new_token_ids)
    return out


def _pull(ctx, rid: int) -> KvPayload:
    """What the TCP transfer carries: the exported blocks copied to the host."""
    transceiver = ctx.kv_transceiver
    exported = transceiver.export(rid, transceiver.opaque_state(rid))
    arrays = [
        np.concatenate([np.asarray(arrays[i])[:n] for n, arrays in exported.chunks])
        for i in range(len(exported.layout))
    ]
    return KvPayload(exported.prompt_token_ids, exported.tokens_per_block, exported.layout, arrays)


def _generation_params(first: list[int], payload: KvPayload) -> DisaggregatedParams:
    return DisaggregatedParams(
        "generation_only",
        first_gen_tokens=first,
        ctx_request_id=0,
        opaque_state="-",
        ctx_info_endpoint="tcp://127.0.0.1:1",
        kv_payload=payload,
    )


def _hand_over(ctx, gen, prompts: list[list[int]], max_tokens: int, zero_blocks: bool = False) -> dict[int, list[int]]:
    context_only = DisaggregatedParams("context_only")
    for i, prompt in enumerate(prompts):
        ctx.add_request(prompt, SamplingParams(max_tokens=1), request_id=i, disaggregated_params=context_only)
    firsts = _run(ctx)
    assert ctx.kv_transceiver.num_held == len(prompts)
    for i, prompt in enumerate(prompts):
        payload = _pull(ctx, i)
        if zero_blocks:
            payload.arrays = [np.zeros_like(a) for a in payload.arrays]
        gen.add_request(
            prompt,
            SamplingParams(max_tokens=max_tokens),
            request_id=100 + i,
            disaggregated_params=_generation_params(firsts[i], payload),
        )
    gen.iteration_stats.clear()
    out = _run(gen)
    assert sum(s["inflightBatchingStats"]["numCtxTokens"] for s in gen.iteration_stats) == 0, "a prompt was recomputed"
    return {i: out[100 + i] for i in range(len(prompts))}


def _check_hand_over(ctx, gen, prompts: list[list[int]], max_tokens: int) -> None:
    free = (ctx.kv_cache_manager.num_free_blocks, gen.kv_cache_manager.num_free_blocks)
    for i, prompt in enumerate(prompts):
        gen.add_request(prompt, SamplingParams(max_tokens=max_tokens), request_id=50 + i)
    whole = _run(gen)
    want = {i: whole[50 + i] for i in range(len(prompts))}
    assert _hand_over(ctx, gen, prompts, max_tokens) == want
    assert _hand_over(ctx, gen, prompts, max_tokens, zero_blocks=True) != want, "the blocks made no difference"
    assert (ctx.kv_cache_manager.num_free_blocks, gen.kv_cache_manager.num_free_blocks) == free


def test_dense_hand_over_equals_one_engine_and_frees_everything():
    config = CacheTransceiverConfig(max_tokens_in_buffer=16)  # several chunks per request
    ctx = tiny_engine("tiny-dense", cache_transceiver_config=config)
    gen = tiny_engine("tiny-dense", cache_transceiver_config={"kv_transfer_timeout_ms": 60_000})
    _check_hand_over(ctx, gen, PROMPTS, max_tokens=9)

    # A claim with the wrong secret, a second claim and an expired hold are refused; nothing leaks.
    free = ctx.kv_cache_manager.num_free_blocks
    ctx.add_request(
        PROMPTS[0], SamplingParams(max_tokens=1), request_id=7, disaggregated_params=DisaggregatedParams("context_only")
    )
    _run(ctx)
    assert ctx.kv_cache_manager.num_free_blocks < free
    with pytest.raises(KeyError, match="opaque_state does not match"):
        ctx.kv_transceiver.export(7, "0" * 64)
    assert ctx.kv_transceiver.expire(now=0.0) == 0
    assert ctx.kv_transceiver.expire(now=float("inf")) == 1
    assert ctx.kv_cache_manager.num_free_blocks == free
    # An answer that ended after all (a stop string) drops its hold: the next expiry frees it.
    ctx.add_request(
        PROMPTS[2], SamplingParams(max_tokens=1), request_id=9, disaggregated_params=DisaggregatedParams("context_only")
    )
    _run(ctx)
    ctx.kv_transceiver.drop(9)
    assert ctx.kv_transceiver.next_deadline() == 0.0
    assert ctx.kv_transceiver.expire() == 1 and ctx.kv_cache_manager.num_free_blocks == free
    with pytest.raises(KeyError, match="not held here"):
        ctx.kv_transceiver.export(7, ctx.kv_transceiver.opaque_state(7))

    # Blocks of another layout or another prompt are refused with the field named.
    ctx.add_request(
        PROMPTS[1], SamplingParams(max_tokens=1), request_id=8, disaggregated_params=DisaggregatedParams("context_only")
    )
    first = _run(ctx)[8]
    payload = _pull(ctx, 8)
    with pytest.raises(ValueError, match="is not this request's"):
        gen.add_request(
            PROMPTS[0], SamplingParams(max_tokens=4), disaggregated_params=_generation_params(first, payload)
        )
    payload.tokens_per_block = 16
    with pytest.raises(ValueError, match="KV layout"):
        gen.add_request(
            PROMPTS[1], SamplingParams(max_tokens=4), disaggregated_params=_generation_params(first, payload)
        )
    assert gen.kv_cache_manager.num_free_blocks == gen.kv_cache_manager.num_blocks
    with pytest.raises(ValueError, match="max_tokens=1"):
        ctx.add_request(
            PROMPTS[0], SamplingParams(max_tokens=3), disaggregated_params=DisaggregatedParams("context_only")
        )
    plain = tiny_engine("tiny-dense")
    with pytest.raises(ValueError, match="without cache_transceiver_config"):
        plain.add_request(
            PROMPTS[0], SamplingParams(max_tokens=1), disaggregated_params=DisaggregatedParams("context_only")
        )
    for engine in (ctx, gen, plain):
        engine.close()


def test_mla_hand_over_equals_one_engine(tmp_path):
    from tests.parallel_workload import small_engine
    from tests.test_deepseek import ENGINE, write_checkpoint

    write_checkpoint(tmp_path / "ds", ENGINE, seed=3, tokenizer=True)
    config = {"kv_transfer_timeout_ms": 60_000}
    # One engine plays both sides (a second DeepSeek engine would double the test's time): the
    # blocks still go out through the export and back in through the import.
    ctx = gen = small_engine(tmp_path / "ds", tmp_path / "ds", cache_transceiver_config=config, decode_batch_sizes=[])
    assert [shape for shape, _ in gen.kv_transceiver.layout][0][-1] == ENGINE["kv_lora_rank"] + ENGINE[
        "qk_rope_head_dim"
    ]
    _check_hand_over(ctx, gen, [[3 + (i * 7) % 200 for i in range(30)], list(range(10, 22))], max_tokens=6)
    ctx.close()


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"backend": "NIXL"}, "backend must be one of DEFAULT, TCP, SHM, TRANSFER, got 'NIXL'"),
        ({"max_tokens_in_buffer": 0}, "max_tokens_in_buffer must be a positive integer, got 0"),
        ({"kv_transfer_timeout_ms": "soon"}, "kv_transfer_timeout_ms must be a positive integer, got 'soon'"),
    ],
)
def test_cache_transceiver_config_errors_name_the_field(fields, message):
    with pytest.raises(ValueError, match="cache_transceiver_config." + message.replace("(", r"\(")):
        CacheTransceiverConfig(**fields)


def test_config_file_and_disaggregated_params_checks(tmp_path):
    from jaxllm.cli import build_parser
    from jaxllm.cli.args import engine_kwargs
    from jaxllm.engine.engine_config import EngineConfig

    path = tmp_path / "worker.yaml"
    path.write_text("cache_transceiver_config:\n  backend: DEFAULT\n  max_tokens_in_buffer: 4096\n")
    kwargs = engine_kwargs(build_parser().parse_args(["generate", "--config", str(path)]))
    config = EngineConfig(model="tiny-dense", **kwargs).cache_transceiver_config
    assert (config.backend, config.max_tokens_in_buffer, config.kv_transfer_timeout_ms) == ("SHM", 4096, 60_000)
    assert CacheTransceiverConfig(backend="tcp").backend == "TCP"
    with pytest.raises(ValueError, match="unknown argument.*: timeout"):
        EngineConfig(model="tiny-dense", cache_transceiver_config={"timeout": 3})
    with pytest.raises(ValueError, match="generation_only request needs first_gen_tokens, ctx_request_id"):
        DisaggregatedParams("generation_only", opaque_state="x", ctx_info_endpoint="tcp://h:1")
    with pytest.raises(ValueError, match="request_type must be one of"):
        DisaggregatedParams("prefill")


@pytest.mark.parametrize(
    "data, message",
    [
        ({"context_servers": {"urls": ["a:1"]}}, "generation_servers is required"),
        (
            {"context_servers": {"num_instances": 2, "urls": ["a:1"]}, "generation_servers": {"urls": ["b:1"]}},
            "context_servers.num_instances is 2 but 1 urls are given",
        ),
        ({"context_servers": {"urls": []}, "generation_servers": {"urls": ["b:1"]}}, "context_servers.urls must be"),
        (
            {"context_servers": {"urls": ["a:1"]}, "generation_servers": {"urls": ["b:1"]}, "prot": 1},
            "unknown field.*prot",
        ),
    ],
)
def test_disagg_yaml_errors_name_the_field(data, message):
    from jaxllm.server.disagg_config import DisaggConfig

    with pytest.raises(ValueError, match=message):
        DisaggConfig.from_dict(data)
    ok = DisaggConfig.from_dict({"context_servers": {"urls": ["a:1"]}, "generation_servers": {"urls": ["http://b:2/"]}})
    assert (ok.context_servers.urls, ok.generation_servers.urls) == (["http://a:1"], ["http://b:2"])


@pytest.fixture(scope="module")
def engines():
    """A context engine (several chunks per request) and a TRANSFER generation engine."""
    ctx = tiny_engine("tiny-dense", cache_transceiver_config={"max_tokens_in_buffer": 16})
    gen = tiny_engine("tiny-dense", cache_transceiver_config={"backend": "TRANSFER"})
    yield ctx, gen
    for engine in (ctx, gen):
        engine.close()


def test_device_transfer_backend_equals_one_engine_and_a_lost_pull_fails_in_time(engines):
    """`backend: TRANSFER` through the KV transfer server in one process (two processes:
    tests/test_disagg_mla.py): the blocks pulled by `jax.experimental.transfer` give the
    tokens of the request run whole; a pull of something never offered fails after its
    timeout instead of waiting for ever, and the transfer server serves on."""
    import jax

    from jaxllm.engine import kv_device_transfer
    from jaxllm.engine.kv_transfer import KvTransferServer, fetch_kv

    ctx, gen = engines
    prompt = PROMPTS[0]
    gen.add_request(prompt, SamplingParams(max_tokens=8), request_id=50)
    want = _run(gen)[50]
    ctx.add_request(
        prompt, SamplingParams(max_tokens=1), request_id=1, disaggregated_params=DisaggregatedParams("context_only")
    )
    first = _run(ctx)[1]
    t = ctx.kv_transceiver
    server = KvTransferServer("127.0.0.1", 0, export=t.export, expire=t.expire, next_deadline=t.next_deadline).start()
    try:
        device = gen.kv_transceiver.device
        payload = fetch_kv(server.endpoint, 1, t.opaque_state(1), transport="TRANSFER", device=device)
        assert payload.backend == "TRANSFER" and payload.arrays == []
        assert [n for n, _ in payload.device_chunks] == [2, 2, 1]  # 35 tokens, 8 per block, 16 per chunk
        gen.add_request(
            prompt, SamplingParams(max_tokens=8), request_id=51, disaggregated_params=_generation_params(first, payload)
        )
        assert _run(gen)[51] == want
        address = kv_device_transfer.advertised_address(kv_device_transfer.transfer_server("127.0.0.1"), "127.0.0.1")
        with pytest.raises(kv_device_transfer.PullError, match="did not finish within 1 s"):
            kv_device_transfer.pull_chunks(address, [12345], [[((4, 8), "float32")]], device, "127.0.0.1", 1.0)
        ids = kv_device_transfer.offer_chunks([(1, [jax.numpy.ones((4, 8))])], "127.0.0.1", 10.0)
        (pulled,) = kv_device_transfer.pull_chunks(address, ids, [[((4, 8), "float32")]], device, "127.0.0.1", 10.0)
        assert float(pulled[0].sum()) == 32.0
    finally:
        server.stop()
    assert ctx.kv_cache_manager.num_free_blocks == ctx.kv_cache_manager.num_blocks
    assert gen.kv_cache_manager.num_free_blocks == gen.kv_cache_manager.num_blocks


def test_logprobs_through_the_hand_over_equal_one_engine(engines):
    """With logprobs, the first token's entry (sampled on the context side) is carried in
    `first_gen_log_probs` and reported by the generation side as its first token's: every
    token's logprobs equal the request run whole. Asking for logprobs without the entry, or
    for prompt_logprobs, is refused."""
    ctx, gen = engines
    prompt = PROMPTS[1]

    def run_logprobs(engine) -> dict[int, tuple[list[int], list[dict]]]:
        out: dict[int, tuple[list[int], list[dict]]] = {}
        while engine.has_unfinished_requests():
            for u in engine.step():
                assert u.error is None, u.error
                tokens, lps = out.setdefault(u.request.request_id, ([], []))
                tokens.extend(u.new_token_ids)
                lps.extend(u.new_logprobs)
        return out

    gen.add_request(prompt, SamplingParams(max_tokens=6, logprobs=3), request_id=50)
    want_tokens, want_lps = run_logprobs(gen)[50]
    ctx.add_request(
        prompt,
        SamplingParams(max_tokens=1, logprobs=3),
        request_id=1,
        disaggregated_params=DisaggregatedParams("context_only"),
    )
    first_tokens, (entry,) = run_logprobs(ctx)[1]
    params = _generation_params(first_tokens, _pull(ctx, 1))
    params.first_gen_log_probs = [[[t, lp.logprob, lp.rank] for t, lp in entry.items()]]
    gen.add_request(prompt, SamplingParams(max_tokens=6, logprobs=3), request_id=51, disaggregated_params=params)
    got_tokens, got_lps = run_logprobs(gen)[51]
    assert got_tokens == want_tokens and len(got_lps) == len(want_lps) == 6
    for got, want in zip(got_lps, want_lps):
        assert got.keys() == want.keys()
        for t in want:
            assert got[t].rank == want[t].rank and got[t].logprob == pytest.approx(want[t].logprob, abs=1e-5)
    params.first_gen_log_probs = None
    with pytest.raises(ValueError, match="first_gen_log_probs is required"):
        gen.add_request(prompt, SamplingParams(max_tokens=6, logprobs=3), disaggregated_params=params)
    with pytest.raises(ValueError, match="prompt_logprobs are not supported"):
        ctx.add_request(
            prompt,
            SamplingParams(max_tokens=1, prompt_logprobs=1),
            disaggregated_params=DisaggregatedParams("context_only"),
        )
    assert ctx.kv_cache_manager.num_free_blocks == ctx.kv_cache_manager.num_blocks
    assert gen.kv_cache_manager.num_free_blocks == gen.kv_cache_manager.num_blocks


def test_shared_memory_segments_are_reused_and_removed_at_close():
    from multiprocessing import shared_memory

    from jaxllm.engine.kv_transfer import SegmentPool

    pool = SegmentPool(keep=2)
    a, b, c = pool.take(1000), pool.take(5000), pool.take(20000)
    names = [s.name for s in (a, b, c)]
    for segment in (a, b, c):
        pool.give(segment)
    assert pool.take(4000) is b  # the smallest kept segment that fits
    with pytest.raises(FileNotFoundError):  # beyond `keep`, the smallest was removed
        shared_memory.SharedMemory(name=names[0])
    pool.give(b)
    pool.close()
    for name in names[1:]:
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=name)
