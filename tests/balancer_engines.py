"""The online expert load balancer's engine set-up, shared by the multi-device engine tests
(tests/test_eplb_online.py, tests/test_quantized_ep_layouts.py): requests arriving over the
steps, a balancer that applies every differing placement (so slots move all the time), and a
watch on the rounds that rewrite slots (every array of each rewritten slot weight donated and
rewritten where it was: same shapes, shardings and device addresses)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import numpy as np


def staggered_workload(
    engine,
    *,
    seed: int,
    last_arrival: int,
    max_tokens: int,
    prompt_lengths: tuple[int, int] = (4, 41),
    token_ids: tuple[int, int] = (3, 256),
    **sampling: Any,
) -> dict[int, list[int]]:
    """Two requests every third step until `last_arrival` (random prompts, lengths and ids in
    the half-open ranges given, chunked by the engine's token budget), `max_tokens` each, run
    to the end; returns each request's tokens by arrival order."""
    from jaxllm import SamplingParams

    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    prompts = {
        step: [[int(t) for t in rng.integers(*token_ids, int(rng.integers(*prompt_lengths)))] for _ in range(2)]
        for step in range(0, last_arrival, 3)
    }
    outputs: dict[int, list[int]] = {}
    first_id = None
    step = 0
    while step in prompts or engine.has_unfinished_requests() or step < max(prompts):
        for p in prompts.get(step, []):
            request = engine.add_request(p, params)
            first_id = request.request_id if first_id is None else first_id
        for update in engine.step():
            outputs.setdefault(update.request.request_id - first_id, []).extend(update.new_token_ids)
        step += 1
    return outputs


def moving_balancer(num_slots: int):
    """One layer rebalanced per step, every differing placement applied (negative gain
    threshold), no move-minimizing mapping: slots move all the time."""
    from sharding.eplb.eplb_config import MoeLoadBalancerConfig

    return MoeLoadBalancerConfig(
        num_slots=num_slots, layer_updates_per_iter=1, min_imbalance_gain=-1.0, minimize_moves=False
    )


def _place(array) -> tuple:
    return (
        array.shape,
        array.sharding,
        [(s.device.id, s.data.unsafe_buffer_pointer()) for s in array.addressable_shards],
    )


class RoundWatch:
    """Records each balancer round that rewrites slots (`rounds`: the layers, the arrays per slot
    weight, whether every old array was donated and every new one sits where the old one did,
    and with `device_memory` the live device bytes before and after the round)."""

    def __init__(self, balancer, device_memory: Optional[Callable[[], int]] = None) -> None:
        self.balancer, self.device_memory = balancer, device_memory
        self.rounds: list[dict] = []
        if device_memory is not None:
            import gc

            # Each round collects garbage twice: with what exists now moved to the permanent
            # generation, a collection scans only what the steps made since (milliseconds, not a
            # fifth of a second), and both measurements of a round still see the same objects.
            gc.collect()
            gc.freeze()
        self._apply = balancer.apply_round
        balancer.apply_round = self._round

    def _arrays(self, params, layers) -> dict:
        import jax

        from jaxllm.engine.load_balancer import moe_layer_params
        from sharding.expert_pool import SLOT_WEIGHTS

        return {(l, n): jax.tree.leaves(moe_layer_params(params, l)[n]) for l in layers for n in SLOT_WEIGHTS}

    def _round(self, params) -> list[int]:
        import gc

        import jax

        if self.device_memory is not None:
            gc.collect()
            before = self.device_memory()
        old = self._arrays(params, self.balancer.layers)
        places = {k: [_place(a) for a in v] for k, v in old.items()}
        updated = self._apply(params)
        if updated:
            new = self._arrays(params, updated)
            jax.block_until_ready(new)
            record = dict(
                layers=list(updated),
                arrays=min(len(v) for v in new.values()),
                donated=all(a.is_deleted() for k in new for a in old[k]),
                same_address=all([_place(a) for a in v] == places[k] for k, v in new.items()),
            )
            if self.device_memory is not None:
                gc.collect()
                record.update(before=before, after=self.device_memory())
            self.rounds.append(record)
        return updated

    @property
    def in_place(self) -> bool:
        """Some round rewrote slots, and every one did so in place."""
        return bool(self.rounds) and all(r["donated"] and r["same_address"] for r in self.rounds)
