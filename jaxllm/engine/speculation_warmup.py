"""Warm-up of speculative decoding: the programs a speculating engine runs, compiled before serving.

Every token bucket's context-logits forward (and the speculative decode buckets'), the
verification program of each sampler variant, and the drafter's program of every shape a step
runs in, each run once on an all-padding step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxllm.batch_builder import token_buckets
from jaxllm.engine.planner import Planner, StepPlan
from jaxllm.sampling import SamplingTensors
from jaxllm.sampling.params import MAX_LOGPROBS
from jaxllm.sampling.rejection import entry_tensors

if TYPE_CHECKING:
    from jaxllm.engine.speculation import Speculation


def warm_up_speculation(
    spec: Speculation, runner: Any, planner: Planner, num_sampler_rows: int, max_seq_len: int, all_variants: bool = True
) -> None:
    """Compile, and run once on empty steps, the context-logits forward of every token
    bucket and the verification program of every sampler variant it can see (only the
    greedy one without `all_variants`, as the engine's warm-up does for the sampler)."""
    variants = [
        dict(num_top_logprobs=top, any_random=random, use_top_k_top_p=sort, use_penalties=penalties)
        for penalties in (False, True)
        for top in (0, MAX_LOGPROBS)
        for random, sort in ((False, False), (True, False), (True, True))
    ]
    if not all_variants:
        variants = variants[:1]
    shapes = [(bucket, None) for bucket in token_buckets(spec.max_num_tokens, spec.min_token_bucket)]
    per_row = planner.spec_tokens_per_row
    shapes += [(rows * per_row, rows) for rows in planner.decode_batch_sizes if rows * per_row <= spec.max_num_tokens]
    ranks = planner.num_ranks  # attention DP: each rank's entries, [ranks, size] indices
    for bucket, rows in shapes:
        size = spec.verify_rows(bucket)
        batch, feed = planner.empty_step(bucket) if rows is None else planner.empty_step(0, rows, bucket)
        sampling = SamplingTensors.empty(num_sampler_rows if rows is None else rows, max_seq_len)
        index = np.zeros(size if ranks == 1 else (ranks, size), np.int32)
        plan = StepPlan(batch, sampling, feed, 0, 0, context_index=index, greedy_only=True)
        result = runner.execute(plan)
        if spec.drafter is not None:
            spec.drafter.warmup(batch)
        for flags in variants:
            tensors = entry_tensors(
                SamplingTensors.empty(num_sampler_rows, max_seq_len, **flags),
                np.zeros(ranks * size, np.int64),
                np.zeros(ranks * size, np.int32),
            )
            tensors = replace(tensors, any_random=flags["any_random"], use_top_k_top_p=flags["use_top_k_top_p"])
            out = spec.launch(result.context_logits, tensors, np.full(ranks * size, -1, np.int32))
        jax.block_until_ready(out.token_ids)
    if spec.drafter is not None:  # the MTP program of the shapes plain steps run in
        plain = [(bucket, None) for bucket in token_buckets(spec.max_num_tokens, spec.min_token_bucket)]
        plain += [(rows, rows) for rows in planner.decode_batch_sizes]
        for bucket, rows in plain:
            batch, feed = planner.empty_step(bucket) if rows is None else planner.empty_step(0, rows)
            sampling = SamplingTensors.empty(num_sampler_rows if rows is None else rows, max_seq_len)
            runner.execute(StepPlan(batch, sampling, feed, 0, 0, greedy_only=True))
            spec.drafter.warmup(batch)
