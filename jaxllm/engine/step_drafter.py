"""Drafters that run after each step on the device: the drafts of step N + 1 come out of step N.

MTP layers (`jaxllm.engine.mtp_drafter`) and a draft model (`jaxllm.engine.draft_model_drafter`)
both keep a page pool addressed by the target's block ids and must see every position the
target processed. After step N is read back every token it processed is known on the host, so
one jitted program per shape runs the drafter over step N's packed tokens (writing its cache at
those positions) and chains the drafts of each generating row from its last kept position.
`StepDrafter` holds what both share: the engine hooks (`dispatched`, `begin_step`), the
proposer interface `Speculation` calls (`propose`, `request_ids`, `release`) and the batch
building (`step_inputs`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Optional

import jax
import numpy as np

from jaxllm.engine.device_reads import to_host
from jaxllm.engine.host_transfer import put_on_mesh
from jaxllm.llm_request import LlmRequest, LlmRequestState
from jaxllm.models.parallel.attention_dp import stack_batches
from jaxllm.step_batch import StepBatch

_GENERATING = LlmRequestState.GENERATION_IN_PROGRESS
_FIELDS = tuple(StepBatch.__dataclass_fields__)


@dataclass
class DispatchedStep:
    """A dispatched step the drafter has not run over yet."""

    batch: StepBatch  # host arrays ([ranks, ...] fields under attention DP)
    requests: list[LlmRequest] | list[list[LlmRequest]]  # by row (each rank's under attention DP)
    hidden: Optional[jax.Array]  # [T, H] the target's hidden states (MTP, EAGLE-3; [ranks, T, H] under attention DP)
    has_context: bool = False  # it processed prompt tokens


class StepDrafter:
    """Engine hooks and proposer interface of a drafter run after each step (engine thread
    only); subclasses give `launch(batch, last_tokens, hidden) -> drafts [S, k]` (the device
    program) and `shift` (see `step_inputs`)."""

    shift = 1

    def __init__(self, runner: Any, num_draft_tokens: int) -> None:
        self.runner = runner
        self.num_draft_tokens = num_draft_tokens
        # What runs `launch` (a multi-host leader's mirrored launcher: every process drafts).
        self.launcher: Any = self.launch
        self._last: Optional[DispatchedStep] = None
        self._drafts: dict[int, list[int]] = {}
        self.steps_run = 0  # drafting programs run
        self._jit: Any = None

    @property
    def num_compiled(self) -> int:
        return int(self._jit._cache_size()) if self._jit is not None else 0

    def dispatched(
        self, batch: StepBatch, requests: list[LlmRequest] | list[list[LlmRequest]], has_context: bool = False
    ) -> None:
        """Step N was dispatched with `batch` over `requests` (by row; under attention DP a
        stacked batch and each rank's requests by row); `has_context`: it processed prompt tokens."""
        self._last = DispatchedStep(batch, list(requests), self.runner.last_hidden, has_context)

    @property
    def pending_context(self) -> bool:
        """Whether the step it has not run over yet processed prompt tokens: it runs over such
        a step whether or not the next step drafts, so its pool holds every prompt position."""
        return self._last is not None and self._last.has_context

    @property
    def pending_shape(self) -> Optional[tuple[int, int]]:
        """(tokens, rows) of the step it has not run over yet (its program's shape), else None."""
        if self._last is None:
            return None
        batch = self._last.batch  # per rank under attention DP
        return int(np.asarray(batch.token_ids).shape[-1]), int(np.asarray(batch.logits_indices).shape[-1])

    def begin_step(self) -> float:
        """Before the next step's drafts are asked for (every token of step N on the host): run
        the drafter over step N and keep each generating row's drafts. Returns the seconds its
        program took (waited for, so the adaptive policy can charge them), 0.0 when none ran."""
        step, self._last = self._last, None
        self._drafts = {}
        if step is None:
            return 0.0
        started = time.perf_counter()
        drafts, rows = self._run(step)
        host = to_host(drafts)  # the drafts are needed now: one blocking read
        seconds = time.perf_counter() - started
        self.steps_run += 1
        if rows:
            host = host.reshape(-1, host.shape[-1])  # attention DP's [ranks, S, k]: rank-major rows
            self._drafts = {rid: host[row].tolist() for row, rid in rows.items()}
        return seconds

    def skip_step(self) -> None:
        """The next step does not draft: the drafter does not run over step N. Its pool then
        holds no entries for step N's positions; later drafts attend to whatever those pages
        hold, which makes them less often accepted, never changes an output token."""
        self._last = None
        self._drafts = {}

    def _run(self, step: DispatchedStep) -> tuple[Any, dict[int, int]]:
        requests: Any = step.requests
        if np.ndim(step.batch.token_ids) == 2:  # attention DP: each rank's rows
            batch, last_tokens, rows = ranked_step_inputs(step.batch, requests, shift=self.shift)
        else:
            batch, last_tokens, rows = step_inputs(step.batch, requests, shift=self.shift)
        return self.launcher(batch, last_tokens, step.hidden), rows

    def launch(self, batch: StepBatch, last_tokens: np.ndarray, hidden: Optional[jax.Array]) -> jax.Array:
        """Run the drafting program over a step's inputs (host arrays) and the target's hidden
        states of that step; returns the drafts [S, k] (device), not waited for."""
        raise NotImplementedError

    def _on_mesh(self, tree: Any) -> Any:
        """Host inputs as they go into the program: as they are on one process, put on the mesh
        piece by piece across several (`put_on_mesh`)."""
        if jax.process_count() == 1:
            return tree
        return put_on_mesh(tree, jax.sharding.NamedSharding(self.runner.mesh, jax.sharding.PartitionSpec()))

    def warmup(self, batch: StepBatch) -> None:
        """Compile (and run on an all-padding step) the drafting program of `batch`'s shape."""
        drafts, _ = self._run(DispatchedStep(batch, [], self.runner.last_hidden))
        jax.block_until_ready(drafts)

    # ------------------------------------------------------------------ proposer interface
    def propose(self, request_id: int, tokens: Any, max_len: Optional[int] = None) -> list[int]:
        draft = self._drafts.get(request_id, [])
        return draft if max_len is None else draft[:max_len]

    def request_ids(self) -> list[int]:
        return []

    def release(self, request_id: int) -> None:
        self._drafts.pop(request_id, None)


def step_inputs(
    batch: StepBatch, requests: list[LlmRequest], shift: int
) -> tuple[StepBatch, np.ndarray, dict[int, int]]:
    """A read-back step's batch for a drafter, its rows' last tokens and {row: request id} of
    the rows that draft. Each packed token at position i gets token t_{i + shift} (0 where it
    is not kept: a rejected draft, past a finished request): shift 1 for MTP (the next token),
    0 for a draft model (the token itself). A generating row's logits index points at its
    last kept position whose next token is known (len(tokens) - 2), and its last token is the
    one the target just produced."""
    token_ids = np.zeros_like(np.asarray(batch.token_ids))
    logits_indices = np.array(batch.logits_indices, copy=True)
    last_tokens = np.zeros(logits_indices.shape[0], np.int32)
    cu = np.asarray(batch.cu_q_lens)
    positions = np.asarray(batch.positions)
    rows: dict[int, int] = {}
    for row, request in enumerate(requests):
        start, end = int(cu[row]), int(cu[row + 1])
        if end <= start:
            continue
        tokens = request.all_token_ids
        first = int(positions[start])
        n = min(end - start, len(tokens) - shift - first)
        if n > 0:
            token_ids[start : start + n] = tokens[first + shift : first + shift + n]
        last = len(tokens) - 2
        if request.state is _GENERATING and first <= last < first + (end - start):
            logits_indices[row] = start + last - first
            last_tokens[row] = tokens[-1]
            rows[row] = request.request_id
    return replace(batch, token_ids=token_ids, logits_indices=logits_indices), last_tokens, rows


def ranked_step_inputs(
    batch: StepBatch, requests: list[list[LlmRequest]], shift: int
) -> tuple[StepBatch, np.ndarray, dict[int, int]]:
    """`step_inputs` of a stacked attention-DP batch ([ranks, ...] fields) over each rank's
    requests by row (missing ranks: none): the stacked batch, last tokens [ranks, S] and the
    drafting rows numbered rank-major (rank d's row i is d * S + i)."""
    num_ranks, num_rows = np.asarray(batch.logits_indices).shape
    batches, last, rows = [], [], {}
    for rank in range(num_ranks):
        local = StepBatch(
            **{f: None if getattr(batch, f) is None else np.asarray(getattr(batch, f))[rank] for f in _FIELDS}
        )
        mine = requests[rank] if rank < len(requests) else []
        rank_batch, rank_last, rank_rows = step_inputs(local, mine, shift)
        batches.append(rank_batch)
        last.append(rank_last)
        rows.update({rank * num_rows + row: rid for row, rid in rank_rows.items()})
    return stack_batches(batches), np.stack(last), rows
