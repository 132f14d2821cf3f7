"""The verification inputs of a drafting step: which packed tokens' logits it needs, and per entry
the sampling settings, the draft it verifies and whether it lies inside a thinking span.

A speculating row of k drafts has k + 1 entries (its fed token and each draft), at its packed
tokens cu_q_lens[row] ... + k. The step's entries are laid out per rank (one rank without
attention DP): rank d's entries fill slots [d * size, (d + 1) * size) of the verification
program's E = ranks * size entries, padded within the rank, and `context_index` is
int32[size] (one rank) or int32[ranks, size] (each rank's own packed indices, as the
attention-DP forward gathers them). Sampler rows are the planner's: rank d's i-th request is
row d * max_batch_size + i.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import numpy as np

from jaxllm.engine.logits_outputs import padded_index
from jaxllm.engine.step_plan import StepPlan
from jaxllm.engine.thinking_phase import ThinkingPhases
from jaxllm.sampling import SamplingTensors
from jaxllm.sampling.rejection import entry_tensors
from jaxllm.scheduler import SchedulerOutput

# A drafting step's verification inputs: (speculating rows, their drafts, their first entries,
# per-entry sampling tensors, per-entry draft ids, per-entry thinking flags or None).
VerifyInputs = tuple[list[int], list[list[int]], list[int], SamplingTensors, np.ndarray, Optional[np.ndarray]]


def verification_inputs(
    plan: StepPlan,
    parts: list[tuple[SchedulerOutput, Any]],
    drafts: dict[int, list[int]],
    *,
    size: int,
    max_batch_size: int,
    thinking: Optional[ThinkingPhases] = None,
) -> tuple[StepPlan, Optional[VerifyInputs]]:
    """The plan with its verification tokens' indices (`context_index`) and the verification
    program's inputs, or the plan unchanged and None when no row drafts. `parts`: each rank's
    scheduler output (`Planner.rank_parts`); `size`: entries per rank."""
    cu = np.asarray(plan.batch.cu_q_lens)
    stacked = cu.ndim == 2  # attention DP: [ranks, S + 1]
    cu = cu if stacked else cu[None]
    step = np.asarray(plan.sampling.step)
    indices: list[np.ndarray] = []
    entry_rows: list[int] = []
    entry_steps: list[int] = []
    draft_ids: list[int] = []
    before: list[list[int]] = []  # each entry's drafts before it (its penalties see them)
    flags: list[bool] = []  # each entry inside a thinking span (relaxed acceptance)
    spec_rows, spec_drafts, starts = [], [], []
    for rank, (part, _) in enumerate(parts):
        index: list[int] = []
        num_ctx = len(part.context_requests)
        for i, request in enumerate(part.all_requests()):
            draft = drafts.get(request.request_id)
            if not draft or i < num_ctx:
                continue
            row, first = rank * max_batch_size + i, int(cu[rank, i])
            spec_rows.append(row)
            spec_drafts.append(draft)
            starts.append(rank * size + len(index))
            index.extend(range(first, first + len(draft) + 1))
            entry_rows.extend([row] * (len(draft) + 1))
            entry_steps.extend(int(step[row]) + j for j in range(len(draft) + 1))
            draft_ids.extend(draft)
            draft_ids.append(-1)
            before.extend(draft[:j] for j in range(len(draft) + 1))
            if thinking is not None:
                flags.extend(thinking.entry_flags(request, draft))
        if len(index) > size:
            raise ValueError(f"{len(index)} verification entries exceed the bucket's {size}")
        pad = size - len(index)
        entry_rows += [rank * max_batch_size] * pad
        entry_steps += [0] * pad
        draft_ids += [-1] * pad
        before += [[]] * pad
        flags += [False] * pad
        indices.append(padded_index(index, size))
    if not spec_rows:
        return plan, None
    tensors = entry_tensors(plan.sampling, np.asarray(entry_rows), np.asarray(entry_steps, np.int32), before)
    plan = replace(plan, context_index=np.stack(indices) if stacked else indices[0])
    thinking_flags = np.asarray(flags, np.bool_) if thinking is not None else None
    return plan, (spec_rows, spec_drafts, starts, tensors, np.asarray(draft_ids, np.int32), thinking_flags)
