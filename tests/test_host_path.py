"""The per-step host path: packed step inputs and the sampling settings kept per KV slot."""

from __future__ import annotations

from dataclasses import fields

import jax
import numpy as np
import pytest

from jaxllm.engine.host_transfer import pack, unpack
from jaxllm.llm_request import LlmRequest
from jaxllm.sampling import SamplingParams, SamplingTensors, resolve_seed
from jaxllm.sampling.slots import SamplingSlots


def test_pack_round_trips_every_bit_through_one_buffer():
    tree = {
        "ids": np.arange(6, dtype=np.int32).reshape(2, 3),
        "f": np.array([1.5, -0.0, np.inf, np.nan, 1e-45], np.float32),
        "seed": np.array([[0xFFFFFFFF, 7]], np.uint32),
        "mask": np.array([[True, False], [False, True]]),
        "empty": np.zeros((0, 4), np.int32),
    }
    buffers, layout = pack(tree)
    assert len(buffers) == 1 and buffers[0].dtype == np.int32
    out = jax.jit(lambda b: unpack(b, layout))(buffers)
    for name, want in tree.items():
        got = np.asarray(out[name])
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert got.tobytes() == want.tobytes(), name  # bit for bit (NaN, -0.0, denormals)
    # The same layout again: the same layout object, a new buffer (the first one may still be
    # read by the runtime), and the new values in it.
    again = {name: (np.asarray(a) + 1).astype(a.dtype) if name != "mask" else ~a for name, a in tree.items()}
    first = buffers[0].copy()
    buffers_again, layout_again = pack(again)
    assert layout_again is layout and buffers_again[0] is not buffers[0]
    assert buffers[0].tobytes() == first.tobytes()
    out = jax.jit(lambda b: unpack(b, layout))(buffers_again)
    for name, want in again.items():
        assert np.asarray(out[name]).tobytes() == want.tobytes(), name
    with pytest.raises(TypeError, match="cannot pack a int64 input"):
        pack({"ids": np.arange(3)})


def _request(rid: int, params: SamplingParams, num_out: int, rng) -> LlmRequest:
    request = LlmRequest(rid, [int(t) for t in rng.integers(3, 90, 5)], params.max_tokens, sampling_params=params)
    request.seed = resolve_seed(params, 0)
    request.end_ids = (2,)
    request.output_token_ids = [int(t) for t in rng.integers(3, 90, num_out)]
    return request


def _general(requests: list[LlmRequest], S: int, H: int) -> SamplingTensors:
    params = [r.sampling_params for r in requests]
    histories = [(r.prompt_token_ids, r.output_token_ids) for r in requests]
    return SamplingTensors.build(
        params,
        [len(r.output_token_ids) for r in requests],
        histories,
        [r.end_ids for r in requests],
        S,
        H,
        seeds=[r.seed for r in requests],
    )


def _assert_same(a: SamplingTensors, b: SamplingTensors) -> None:
    for f in fields(SamplingTensors):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), f.name
        else:
            assert x == y, f.name


def test_slots_give_the_general_tensors_across_steps_and_slot_reuse():
    """Random mixes of plain and special settings, rows moving between slots and slots
    changing owners: every step equals SamplingTensors.build of the same rows."""
    rng = np.random.default_rng(0)
    choices = [
        dict(),
        dict(temperature=0.0),
        dict(temperature=0.7, seed=5),
        dict(temperature=1.2, top_k=4),
        dict(temperature=0.9, top_p=0.8, min_p=0.05),
        dict(temperature=0.5),  # unseeded: engine seed
        dict(repetition_penalty=1.3),
        dict(min_tokens=3),
        dict(logprobs=2),
        dict(logprobs=0),
        dict(bad_token_ids=[7]),
        dict(temperature=0.8, presence_penalty=0.5, seed=3),
    ]
    S, H, num_slots = 8, 32, 6
    slots = SamplingSlots(2)  # grows on demand
    plain_steps = special_steps = 0
    requests = []
    for step in range(60):
        # Replace some requests, keep others (with one more output token).
        keep = [r for r in requests if rng.random() < 0.7]
        for r in keep:
            r.output_token_ids.append(int(rng.integers(3, 90)))
        while len(keep) < int(rng.integers(1, num_slots + 1)):
            kw = choices[int(rng.integers(len(choices)))] if rng.random() < 0.4 else choices[int(rng.integers(6))]
            keep.append(
                _request(1000 * step + len(keep), SamplingParams(max_tokens=20, **kw), int(rng.integers(0, 5)), rng)
            )
        requests = keep
        slot_of = rng.permutation(num_slots)[: len(requests)].tolist()  # slots may change hands
        got = slots.build(requests, slot_of, S, H, lambda: _general(requests, S, H))
        _assert_same(got, _general(requests, S, H))
        plain = all(
            not r.sampling_params.needs_history
            and r.sampling_params.logprobs is None
            and not r.sampling_params.bad_token_ids
            and r.sampling_params.min_tokens == 0
            for r in requests
        )
        plain_steps += plain
        special_steps += not plain
    assert plain_steps > 10 and special_steps > 10  # both paths were exercised


def test_token_log_writes_tokens_in_step_order_and_owes_in_flight_placeholders():
    """A `DecodeTokenLog` keeps steps' tokens out of the requests until flushed: a row's own
    flush, a full log and `materialize` each leave every list equal to its tokens so far
    (materialize adding one placeholder per committed step not yet recorded)."""
    from jaxllm.engine.token_log import PLACEHOLDER_TOKEN, DecodeTokenLog

    with pytest.raises(ValueError, match="capacity"):
        DecodeTokenLog([], capacity=0)
    rng = np.random.default_rng(3)
    params = SamplingParams(max_tokens=20)
    requests = [_request(i, params, 2, rng) for i in range(3)]
    expected = [list(r.output_token_ids) for r in requests]
    log = DecodeTokenLog(requests, capacity=2)
    for step in range(5):
        log.commit()
        tokens = np.arange(3, dtype=np.int32) * 100 + step
        log.record(tokens)
        for row, token in enumerate(tokens.tolist()):
            expected[row].append(token)
        if step == 2:
            log.flush_rows([1])  # a row whose block is indexed: its list is current now
            assert requests[1].output_token_ids == expected[1]
    with pytest.raises(RuntimeError, match="more steps than were committed"):
        log.record(np.zeros(3, np.int32))
    log.commit()  # a step in flight
    log.materialize()
    assert [r.output_token_ids for r in requests] == [e + [PLACEHOLDER_TOKEN] for e in expected]
    assert not log.live
    log.materialize()  # ended: nothing more
    assert [len(r.output_token_ids) for r in requests] == [len(e) + 1 for e in expected]
