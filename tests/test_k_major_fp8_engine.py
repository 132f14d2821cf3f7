"""FP8 block weights stored K-major, as the engine stores them for the Mosaic GPU FP8 kernels
(`moe_backend="mosaic"`; the default `pallas` on Hopper), on a DeepSeek-style FP8 checkpoint
(128 x 128 blocks, activations quantized per 128-group).

On one device the routed experts run on the e4m3 x e4m3 kernels in jax's Mosaic GPU
interpreter and give the XLA engine's greedy tokens. The interpreter runs one device only
(it stalls under a multi-device `shard_map`), so the layouts run on 2 fake CPU devices in a
subprocess with K-major storage on the XLA path (every weight read through
`QuantizedWeight.param_value`): tensor parallelism splitting the experts' columns and expert
parallelism with the online balancer rewriting K-major slots give the one-device tokens."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxllm.models.quantized_loading import describe_weights
from pallas_kernels import mosaic_gpu_interpret
from tests.balancer_engines import RoundWatch, moving_balancer
from tests.multidevice import FAST_COMPILE, run_on_cpu_devices

pytestmark = pytest.mark.skipif(not mosaic_gpu_interpret.available(), reason="no Mosaic GPU interpreter")

NUM_SLOTS = 10  # 8 experts and two replicas over 2 EP ranks


# Greedy tokens under FP8 with activations quantized per 128-group: a layout's different
# summation order moves logprobs by about 1e-6, and now and then that moves one activation across
# an e4m3 rounding midpoint, a jump of up to a few hundredths in that request's logprobs (seen
# once in 8 requests of 12 tokens, one request off by 0.08 from its first token, the other seven
# within 4e-6). A request's tokens must equal the reference's up to where the reference's top
# two were within TIE of each other; after such a tie the runs may go their own ways. The
# workload stays short, as the rare jump would fail the comparison.
TIE = 1e-3


def _workload(engine, last_arrival: int = 7, max_tokens: int = 6) -> dict[int, list[list[float]]]:
    """Two requests every third step until `last_arrival` (as `staggered_workload`): per request
    by arrival order, per token [token, logprob gap between the two most likely tokens]."""
    from jaxllm import SamplingParams

    rng = np.random.default_rng(3)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, logprobs=2)
    prompts = {
        step: [rng.integers(3, 256, int(rng.integers(4, 25))).tolist() for _ in range(2)]
        for step in range(0, last_arrival, 3)
    }
    outputs: dict[int, list[list[float]]] = {}
    first_id, step = None, 0
    while step in prompts or engine.has_unfinished_requests() or step < max(prompts):
        for prompt in prompts.get(step, []):
            request = engine.add_request(prompt, params)
            first_id = request.request_id if first_id is None else first_id
        for update in engine.step():
            for token, entry in zip(update.new_token_ids, update.new_logprobs):
                top = sorted((lp.logprob for lp in entry.values()), reverse=True)
                outputs.setdefault(update.request.request_id - first_id, []).append([token, top[0] - top[1]])
        step += 1
    return outputs


def agree(out: dict, reference: dict) -> bool:
    """`out`'s tokens are the reference's up to the first near-tie of the reference (see TIE)."""
    if sorted(out) != sorted(reference):
        return False
    for key, ref in reference.items():
        for (token, _), (ref_token, gap) in zip(out[key], ref):
            if token != ref_token:
                if gap >= TIE:
                    return False
                break
    return True


def new_engine(root: Path, **kwargs):
    from jaxllm import KvCacheConfig
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=str(root / "ds"),
            dtype="float32",
            max_batch_size=4,
            max_num_tokens=16,
            max_seq_len=64,
            compile_ahead=False,
            decode_batch_sizes=[],
            kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=512, enable_block_reuse=False),
            **kwargs,
        )
    )


def experts_k_major(engine) -> bool:
    """The MoE layer's routed experts (layer 1) are stored K-major ([.., N, K])."""
    from jaxllm.engine.load_balancer import moe_layer_params
    from sharding.expert_pool import SLOT_WEIGHTS

    moe = moe_layer_params(engine.runner.params, 1)
    return all(moe[n].k_major and moe[n].value.shape[-2:] == moe[n].shape[:-3:-1] for n in SLOT_WEIGHTS)


def check_all(root: Path) -> None:
    """Subprocess entry point (2 devices): one JSON line per engine."""
    from jaxllm.engine import builder
    from jaxllm.engine.load_balancer import moe_layer_params
    from jaxllm.llm_args import MoeConfig

    # K-major storage as for the Mosaic kernels, read by the XLA path (see the module docstring).
    builder.mosaic_fp8_selected = lambda *args: True
    new = functools.partial(new_engine, root, moe_backend="xla")

    base = new()
    base_tokens = _workload(base)
    print(json.dumps(dict(kind="one_device", k_major=experts_k_major(base))), flush=True)
    base.close()

    engine = new(tensor_parallel_size=2)
    tokens = _workload(engine)
    w_gate = moe_layer_params(engine.runner.params, 1)["w_gate"]
    record = dict(
        kind="tp",
        k_major=experts_k_major(engine),
        same_tokens=agree(tokens, base_tokens),
        shape=list(w_gate.shape),  # [.., E, H, I] in the parameter's layout
        shard=list(w_gate.value.addressable_shards[0].data.shape),  # of the K-major value [.., E, I, H]
    )
    print(json.dumps(record), flush=True)
    engine.close()

    engine = new(
        tensor_parallel_size=2,
        moe_expert_parallel_size=2,
        moe_config=MoeConfig(load_balancer=moving_balancer(NUM_SLOTS)),
    )
    balancer = engine.load_balancer
    watch = RoundWatch(balancer)
    first = {l: balancer.tables[l].copy() for l in balancer.layers}
    tokens = _workload(engine)
    balancer.worker.wait_idle()
    print(
        json.dumps(
            dict(
                kind="ep_balancer",
                k_major=experts_k_major(engine),
                same_tokens=agree(tokens, base_tokens),
                num_tokens=sum(map(len, tokens.values())),
                ties=sum(gap < TIE for ref in base_tokens.values() for _, gap in ref),
                tables_changed=any(not np.array_equal(first[l], balancer.tables[l]) for l in balancer.layers),
                slots_rewritten=balancer.stats.slots_rewritten,
                rounds=watch.rounds,
            )
        ),
        flush=True,
    )
    engine.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    pytest.importorskip("torch")
    from jaxllm.models import materialize_preset
    from tests.fp8_checkpoints import write_fp8_checkpoint
    from tests.test_deepseek import build_hf
    from tests.test_fp8_weights import DS

    root = tmp_path_factory.mktemp("k_major")
    # Expert columns of 256: two tensor ranks get 128 each, one scale block (the kernel takes them).
    write_fp8_checkpoint(root / "ds", build_hf(dict(DS, moe_intermediate_size=256)))
    preset = materialize_preset("tiny-moe")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (preset / name).exists():
            shutil.copy(preset / name, root / "ds" / name)
    return root


@pytest.fixture(scope="module")
def results(checkpoint) -> dict[str, dict]:
    lines = run_on_cpu_devices(
        "test_k_major_fp8_engine", "check_all", checkpoint, num_devices=2, xla_flags=FAST_COMPILE
    )
    return {r["kind"]: r for r in lines}


def test_the_mosaic_engine_stores_experts_k_major_and_gives_the_xla_tokens(checkpoint):
    """One device: the routed experts on the Mosaic FP8 kernels (interpreted), read as stored."""
    engine = new_engine(checkpoint, moe_backend="mosaic")
    assert experts_k_major(engine) and "K-major" in describe_weights(engine.model_config)
    tokens = _workload(engine, last_arrival=4, max_tokens=4)  # the interpreter is slow: 4 requests
    engine.close()
    engine = new_engine(checkpoint, moe_backend="xla")
    assert not experts_k_major(engine) and "K-major" not in describe_weights(engine.model_config)
    assert agree(_workload(engine, last_arrival=4, max_tokens=4), tokens)
    engine.close()


def test_the_engine_stores_fp8_experts_k_major_for_the_mosaic_kernels(results):
    assert all(r["k_major"] for r in results.values()), results


def test_tensor_parallel_k_major_experts_give_the_one_device_tokens(results):
    r = results["tp"]
    assert r["same_tokens"]
    *lead, hidden, inter = r["shape"]
    assert r["shard"] == [*lead, inter // 2, hidden], r  # the expert columns split, now the value's rows


def test_the_balancer_rewrites_k_major_slots_in_place_and_the_tokens_hold(results):
    r = results["ep_balancer"]
    assert r["same_tokens"] and r["num_tokens"] == 6 * 6  # two requests at steps 0, 3, 6
    assert r["tables_changed"] and r["slots_rewritten"] > 0
    assert r["rounds"] and all(x["donated"] and x["arrays"] >= 2 for x in r["rounds"]), r["rounds"]
