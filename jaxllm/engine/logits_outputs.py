"""Logits that requests ask for: context logits, generation logits, prompt logprobs, and the
rows that logits post-processors rewrite.

Nothing here runs for a step in which no row asks. The plain step keeps its compiled
programs and shapes; a step where some row asks adds, to the same plan:
  * `context_index` int32[E]: packed token indices whose logits the model forward also
    returns (a second compiled variant of the forward, keyed by its input layout, with an
    extra output of E rows; E is a bucket >= the tokens asked for, so only those rows are
    computed, kept and copied to the host);
  * `logits_rows` int32[R]: sampler rows whose raw logits (the model output, before any
    post-processor) are gathered on the device and copied back with the step's tokens;
  * `processor_rows` int32[R]: rows that go to host logits processors
    (`jaxllm.engine.logits_processing`);
  * `batched_processors`: per registered device-side processor, the request ids and mask
    of the rows that selected it.
R is a power of two >= the rows asked for (at most max_batch_size), so the gather programs
compile once per R. Results are kept per request in a `LogitsRecord`, indexed by prompt
position and output index, so chunked prefill, recomputation after a pause and the
overlap scheduler's discarded extra token all land in the right place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import numpy as np

from jaxllm.batch_builder import choose_token_bucket
from jaxllm.engine.device_reads import all_to_host
from jaxllm.engine.logits_processing import host_processor_hook
from jaxllm.outputs import Logprob


def row_bucket(n: int, limit: int) -> int:
    """Rows gathered for `n` asking rows: the next power of two, at most `limit`."""
    return min(limit, 1 << max(0, n - 1).bit_length())


def row_buckets(limit: int) -> list[int]:
    """Every size `row_bucket` can return for at most `limit` rows."""
    sizes = sorted({row_bucket(n, limit) for n in (1 << k for k in range(limit.bit_length() + 1))})
    return [s for s in sizes if s <= limit]


def padded_index(values: list[int], size: int) -> np.ndarray:
    """`values` as int32[size], padded by repeating the first value (a padded gather reads a
    real row; a padded scatter writes that row's own new value again)."""
    out = np.full(size, values[0] if values else 0, np.int32)
    out[: len(values)] = values
    return out


# Prompt logprobs are computed this many positions at a time (float64 log-softmax
# temporaries of [rows, vocab]), as each step's context rows arrive.
PROMPT_LOGPROBS_ROWS = 64


@dataclass
class LogitsRecord:
    """What one request asked for and what came back so far (host arrays).

    Prompt logprobs are computed from each step's context rows as they arrive and only the
    entries are kept, so a request that asks for them alone never holds its prompt's
    [prompt_len, vocab] logits on the host (only `keep_context`, `return_context_logits`,
    keeps those)."""

    prompt_token_ids: list[int]
    keep_context: bool = True  # keep the [prompt_len, vocab] context logits
    prompt_k: Optional[int] = None  # prompt_logprobs: top-k per prompt position (None: not asked)
    context: Optional[np.ndarray] = None  # float32 [prompt_len, vocab], filled by position
    context_filled: int = 0  # prompt positions written (recomputation rewrites the same ones)
    generation: list[Optional[np.ndarray]] = field(default_factory=list)  # by output index
    prompt_entries: Optional[list[Optional[dict[int, Logprob]]]] = None  # by prompt position

    def store_context(self, start: int, rows: np.ndarray) -> None:
        if self.prompt_k is not None:
            self._store_prompt_logprobs(start, rows)
        if self.keep_context:
            if self.context is None:
                self.context = np.zeros((len(self.prompt_token_ids), rows.shape[-1]), np.float32)
            self.context[start : start + len(rows)] = rows
        self.context_filled = max(self.context_filled, start + len(rows))

    def _store_prompt_logprobs(self, start: int, rows: np.ndarray) -> None:
        """Entries of the prompt tokens after positions start.. (row i predicts token start+i+1)."""
        prompt = self.prompt_token_ids
        if self.prompt_entries is None:
            self.prompt_entries = [None] * len(prompt)
        count = min(len(rows), len(prompt) - 1 - start)
        for lo in range(0, max(count, 0), PROMPT_LOGPROBS_ROWS):
            hi = min(count, lo + PROMPT_LOGPROBS_ROWS)
            entries = prompt_logprobs_rows(rows[lo:hi], prompt[start + lo + 1 : start + hi + 1], self.prompt_k)
            self.prompt_entries[start + lo + 1 : start + hi + 1] = entries

    def store_generation(self, index: int, row: np.ndarray) -> None:
        gen = self.generation
        if index >= len(gen):
            gen.extend([None] * (index + 1 - len(gen)))
        gen[index] = row

    def outputs(self, params: Any, num_outputs: int) -> dict:
        """The finished request's logits outputs, named as in the result objects."""
        out: dict = {}
        if params.return_context_logits and self.context is not None:
            out["context_logits"] = self.context
        if params.prompt_logprobs is not None and self.context_filled:
            out["prompt_logprobs"] = [None] + (self.prompt_entries or [None])[1:]
        if params.return_generation_logits:
            rows = [r for r in self.generation[:num_outputs] if r is not None]
            vocab = self.context.shape[-1] if self.context is not None else (rows[0].shape[-1] if rows else 0)
            out["generation_logits"] = np.stack(rows) if rows else np.zeros((0, vocab), np.float32)
        return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return (x - np.log(np.exp(x).sum(axis=-1, keepdims=True))).astype(np.float32)


def prompt_logprobs_rows(logits: np.ndarray, tokens: list[int], k: int) -> list[dict[int, Logprob]]:
    """The prompt logprob entries of `tokens`, token i predicted by logits row i: the actual
    token's logprob with its rank among all tokens, and the `k` most likely tokens (ranks 1..k)."""
    lps = log_softmax(logits[: len(tokens)])
    out = []
    for i, token in enumerate(tokens):
        row = lps[i]
        entry: dict[int, Logprob] = {}
        if k:
            top = np.argpartition(-row, k - 1)[:k]
            top = top[np.argsort(-row[top], kind="stable")]
            for rank, t in enumerate(top.tolist()):
                entry[t] = Logprob(float(row[t]), rank + 1)
        if token not in entry:
            entry[token] = Logprob(float(row[token]), int((row > row[token]).sum()) + 1)
        out.append(entry)
    return out


@dataclass
class StepLogitsTargets:
    """Which requests receive which rows of a step's logits outputs."""

    context: list[tuple[Any, int, int, int]] = field(default_factory=list)  # (request, start, count, offset)
    generation: list[tuple[Any, int, int]] = field(default_factory=list)  # (request, row, offset in logits_rows)
    processors: list[tuple[Any, int]] = field(default_factory=list)  # (request, row) for host processors


def plan_step_logits(
    rows: list,
    num_context: int,
    cu_q_lens: np.ndarray,
    token_bucket: int,
    min_token_bucket: int,
    max_batch_size: int,
    choose_rows: Optional[Callable[[int, int], int]] = None,
) -> tuple[dict, Optional[StepLogitsTargets]]:
    """The plan fields (see module docstring) of a step whose row i is `rows[i]` (context
    requests first, before `commit`), and who gets what; ({}, None) when no row asks.
    `choose_rows(bucket, count)`: E for `count` context rows (None: the smallest bucket)."""
    targets = StepLogitsTargets()
    context_index: list[int] = []
    gen_rows: list[int] = []
    batched: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for row, request in enumerate(rows):
        record = request.logits_record
        params = request.sampling_params
        if record is None and params.logits_post_processor_name is None:
            continue
        is_context = row < num_context
        produces_token = not is_context or request.is_last_context_chunk
        if is_context and record is not None and params.wants_context_logits:
            start = request.context_current_position
            # Past the original prompt are generated tokens recomputed after a pause.
            count = min(request.context_chunk_size, len(record.prompt_token_ids) - start)
            if count > 0:
                offset = int(cu_q_lens[row])
                targets.context.append((request, start, count, len(context_index)))
                context_index.extend(range(offset, offset + count))
        if not produces_token:
            continue
        if params.return_generation_logits:
            targets.generation.append((request, row, len(gen_rows)))
            gen_rows.append(row)
        if params.logits_processor is not None:
            targets.processors.append((request, row))
        name = params.logits_post_processor_name
        if name is not None:
            ids, mask = batched.setdefault(
                name, (np.zeros(max_batch_size, np.int32), np.zeros(max_batch_size, np.bool_))
            )
            ids[row] = request.request_id & 0x7FFFFFFF
            mask[row] = True
    fields: dict = {}
    if context_index:
        size = (
            choose_token_bucket(len(context_index), token_bucket, min_token_bucket)
            if choose_rows is None
            else choose_rows(token_bucket, len(context_index))
        )
        fields["context_index"] = padded_index(context_index, size)
    if gen_rows:
        fields["logits_rows"] = padded_index(gen_rows, row_bucket(len(gen_rows), max_batch_size))
    if targets.processors:
        proc = [row for _, row in targets.processors]
        fields["processor_rows"] = padded_index(proc, row_bucket(len(proc), max_batch_size))
    if batched:
        fields["batched_processors"] = tuple((name, ids, mask) for name, (ids, mask) in sorted(batched.items()))
    if not fields:
        return {}, None
    return fields, targets


@dataclass
class StepLogits:
    """A step's logits outputs from its launch to its read-back: who gets which rows, and the
    failures of its host logits processors (collected by the hook while the step runs)."""

    targets: StepLogitsTargets
    processor_failures: list = field(default_factory=list)

    def processor_hook(self) -> Optional[Callable[..., Any]]:
        """The host callback that runs the requests' logits processors (None when none has one)."""
        if not self.targets.processors:
            return None
        return host_processor_hook([request for request, _ in self.targets.processors], self.processor_failures)

    def attach(self, pending: Any, result: Any) -> None:
        """Hand the step's logits outputs (`result`: the runner's `StepOutput`) to its `PendingStep`."""
        targets = self.targets
        if targets.processors:
            pending.processor_requests = tuple(request for request, _ in targets.processors)
            pending.processor_rows = tuple(row for _, row in targets.processors)
            pending.processed_output = result.processed
            pending.processor_failures = self.processor_failures
        pending.logits_targets = targets
        pending.context_logits = result.context_logits if targets.context else None
        pending.row_logits = result.row_logits if targets.generation else None


def plan_logits_outputs(
    plan: Any,
    output: Any,
    min_token_bucket: int,
    max_batch_size: int,
    choose_rows: Optional[Callable[[int, int], int]] = None,
) -> tuple[Any, Optional[StepLogits]]:
    """`plan` with the logits-output fields of the scheduled step `output` (before `commit`),
    and what the step carries to its read-back; (plan, None) when no row asks for any."""
    fields, targets = plan_step_logits(
        output.all_requests(),
        len(output.context_requests),
        plan.batch.cu_q_lens,
        plan.batch.token_ids.shape[-1],
        min_token_bucket,
        max_batch_size,
        choose_rows,
    )
    if targets is None:
        return plan, None
    return replace(plan, **fields), StepLogits(targets)


def store_step_logits(
    targets: StepLogitsTargets, context: Optional[Any], row_logits: Optional[Any], entries: list
) -> None:
    """Copy a finished step's logits outputs to the host and into each request's record.
    `entries` are the step's (request, row, output index) from `Planner.commit`."""
    context, row_logits = all_to_host(  # one blocking read for both
        context if targets.context else None, row_logits if targets.generation else None
    )
    if targets.context and context is not None:
        host = context
        for request, start, count, offset in targets.context:
            request.logits_record.store_context(start, host[offset : offset + count])
    if targets.generation and row_logits is not None:
        host = row_logits
        index_of_row = {row: index for request, row, index in entries}
        for request, row, offset in targets.generation:
            index = index_of_row.get(row)
            if index is not None and not request.is_finished:
                request.logits_record.store_generation(index, host[offset].copy())
