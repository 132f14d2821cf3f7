"""The multi-host plan encoding: every message the leader sends comes back equal (types, dtypes,
shapes, values, the sampler's static switches), and bytes naming anything but this project's
dataclasses, enums and named tuples are refused."""

from __future__ import annotations

import dataclasses
import enum
import json
from pathlib import Path

import numpy as np
import pytest

from jaxllm.engine import plan_channel
from jaxllm.engine.plan_channel import MessageError, decode, encode


def assert_same(a, b, where="message"):
    """Equal values of the same types, recursively (arrays: dtype, shape and every element)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), where
        assert b.flags.writeable, f"{where}: a decoded array is read-only"
    elif dataclasses.is_dataclass(a):
        assert vars(a).keys() == vars(b).keys(), where
        for name in vars(a):
            assert_same(getattr(a, name), getattr(b, name), f"{where}.{name}")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, float) and np.isnan(a):
        assert np.isnan(b), where
    else:
        assert a == b, where


def planned_steps() -> list:
    """The plans of a small run on the host planner: greedy, sampled, penalised and logprob rows,
    chunked prefill then decode."""
    from jaxllm.engine.planner import PLACEHOLDER_TOKEN, Planner
    from jaxllm.kv_cache import KVCacheManager
    from jaxllm.llm_args import SchedulerConfig
    from jaxllm.llm_request import LlmRequest
    from jaxllm.sampling import SamplingParams
    from jaxllm.scheduler import make_scheduler

    kv = KVCacheManager(64, 8, 12, enable_block_reuse=True, max_num_sequences=4)
    planner = Planner(
        scheduler=make_scheduler(SchedulerConfig(), kv, 4, 32, True),
        kv_cache_manager=kv,
        max_batch_size=4,
        max_num_tokens=32,
        min_token_bucket=16,
        max_blocks_per_seq=12,
        max_seq_len=96,
    )
    settings = [
        dict(),
        dict(temperature=0.8, top_k=5, top_p=0.9),
        dict(repetition_penalty=1.2, logprobs=2),
        dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.1, min_tokens=2),
    ]
    rng = np.random.default_rng(0)
    requests = [
        LlmRequest(
            i,
            [int(t) for t in rng.integers(3, 200, n)],
            3,
            sampling_params=SamplingParams(max_tokens=3, ignore_eos=True, **s),
            seed=i,
        )
        for i, (n, s) in enumerate(zip((30, 3, 12, 5), settings))
    ]
    plans, active = [], list(requests)
    while active:
        step = planner.plan(active)
        plans.append(step.plan)
        for request, _, index in step.entries:
            assert request.output_token_ids[index] == PLACEHOLDER_TOKEN
            request.output_token_ids[index] = 7
            if len(request.output_token_ids) >= 3:
                request.finish("length")
                kv.free_resources(request)
        active = [r for r in active if not r.is_finished]
        assert len(plans) < 50
    return plans


def test_every_message_round_trips():
    from jaxllm.engine.engine_config import EngineConfig
    from jaxllm.engine.followers import LatestOutput

    plans = planned_steps()
    assert len({p.batch.num_tokens_padded for p in plans}) > 1
    switches = {(p.sampling.use_penalties, p.sampling.any_random, p.sampling.num_top_logprobs) for p in plans}
    assert any(s[0] for s in switches) and any(s[1] for s in switches) and any(s[2] for s in switches)

    config = EngineConfig(
        model="/models/m",
        max_batch_size=4,
        max_seq_len=96,
        kv_cache_config={"max_tokens": 512},
        scheduler_config={"capacity_scheduler_policy": "max_utilization"},
        moe_config={
            "load_balancer": {"num_slots": 4, "initial_global_assignments": {0: [0, 1, 2, 3], 1: [3, 2, 1, 0]}},
            "capacity_factor": 1.5,
        },
        multihost_plan_channel="collective",
    )
    messages = [("engine", config), ("stop",)]
    for plan in plans:
        messages += [
            ("call", "execute", (plan,)),
            ("compile", "compile_forward", (plan.batch, plan.feed_index)),
            ("call", "forward", (plan.batch, plan.feed_index, None)),
            ("call", "forward", (plan.batch, plan.feed_index, LatestOutput("forward", 0))),
            ("compile", "compile_sampler", (LatestOutput("forward", 0), plan.sampling)),
            ("call", "sample", (LatestOutput("forward", 0), plan.sampling)),
        ]
    for message in messages:
        payload = encode(message)
        assert isinstance(payload, bytes) and payload.startswith(plan_channel.MAGIC)
        assert_same(message, decode(payload))
    back = decode(encode(("engine", config)))[1]
    assert back == config and back.scheduler_config.capacity_scheduler_policy.value == "MAX_UTILIZATION"
    assert back.moe_config.load_balancer.initial_global_assignments == {0: [0, 1, 2, 3], 1: [3, 2, 1, 0]}

    odd = (
        np.float32(2.5),
        np.bool_(True),
        b"\x00\x01",
        {1: "a", (2, 3): None},
        frozenset({4}),
        {5},
        float("nan"),
        float("-inf"),
        Path("/tmp/x"),
        np.zeros((0, 3), np.int64),
        np.arange(6, dtype=np.uint16)[::2],
        np.array(["ab", "c"]),
        np.array(3.0),
    )
    back = decode(encode(odd))
    assert_same(odd[:-4], back[:-4])
    assert back[-4].shape == (0, 3) and back[-3].tolist() == [0, 2, 4] and back[-2].tolist() == ["ab", "c"]
    assert back[-1].shape == () and back[-1] == 3.0


def payload_with(tree, arrays=()) -> bytes:
    header = json.dumps({"tree": tree, "arrays": list(arrays)}).encode()
    return plan_channel.MAGIC + plan_channel._HEADER_LENGTH.pack(len(header)) + header


class Colour(enum.Enum):
    RED = 1


@dataclasses.dataclass
class Outside:
    x: int = 0


def test_refuses_what_is_not_a_plain_message():
    for name in (
        "builtins:print",
        "os:system",
        "subprocess:Popen",
        "jaxllm.engine.followers:follow",
        "jaxllm.engine.plan_channel:MessageError",
        "jaxllm.engine.engine_config:missing",
        "jaxllm.engine.engine_config:EngineConfig.__post_init__",
    ):
        for tag, rest in (("dataclass", {"fields": {}}), ("enum", {"value": 1}), ("namedtuple", {"items": []})):
            with pytest.raises(MessageError, match="may not refer|does not exist|is not a"):
                decode(payload_with({tag: name, **rest}))
    with pytest.raises(MessageError, match="magic"):
        decode(b"\x80\x05" + encode(("stop",)))
    whole = encode(("call", "execute", (np.arange(100, dtype=np.int32),)))
    with pytest.raises(MessageError, match="truncated"):
        decode(whole[:-8])
    with pytest.raises(MessageError, match="malformed"):
        decode(payload_with({"array": 3}))
    with pytest.raises(MessageError, match="cannot hold a"):
        decode(payload_with({"array": 0}, [["|O", [1], 0]]))
    for bad in (Outside(), Colour.RED, np.array([object()]), print, Ellipsis):
        with pytest.raises(MessageError, match="cannot hold|only this project"):
            encode(("call", "execute", (bad,)))
