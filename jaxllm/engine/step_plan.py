"""What a planned step is: its device inputs (`StepPlan`), the options it was planned under
(`PlannerOptions`) and the token entries of the requests it gives a token to.

Plain data shared by the planner (`jaxllm.engine.planner`, which re-exports these names), the
runner and the read-back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import numpy as np

from jaxllm.engine.token_log import DecodeTokenLog
from jaxllm.llm_request import LlmRequest
from jaxllm.sampling import SamplingTensors
from jaxllm.step_batch import StepBatch

# A request that gets a token from a step: (request, row in the step, index in output_token_ids).
TokenEntry = tuple[LlmRequest, int, int]


class DecodeEntries:
    """The token entries of a steady decode step: request i in row i gets output `index[i]`.

    Kept as the batch's request list and index array; the tuples are built only when a
    consumer iterates them (logits outputs, the general read-back, beam filtering), which
    most steady steps never do. Iterates, indexes and measures like `list[TokenEntry]`."""

    __slots__ = ("requests", "index", "log", "_tuples")

    def __init__(self, requests: list[LlmRequest], index: np.ndarray, log: Optional[DecodeTokenLog] = None) -> None:
        self.requests = requests
        self.index = index  # int64[n] index in output_token_ids of each row's token
        # The batch's token log when the step was committed to it (no placeholders in the
        # lists): its tokens go to the log while it is live, into the lists once it ended.
        self.log = log
        self._tuples: Optional[list[TokenEntry]] = None

    def tuples(self) -> list[TokenEntry]:
        if self._tuples is None:
            self._tuples = list(zip(self.requests, range(len(self.requests)), self.index.tolist()))
        return self._tuples

    def __iter__(self):
        return iter(self.tuples())

    def __len__(self) -> int:
        return len(self.requests)

    def __getitem__(self, i):
        return self.tuples()[i]


@dataclass
class StepPlan:
    """The device inputs of one step, as plain host arrays.

    `feed_index[t] >= 0` means token `t` is the token sampled in row `feed_index[t]` of the
    previous step (not yet known on the host); the runner keeps that step's output.
    """

    batch: StepBatch  # numpy arrays of one token bucket
    sampling: SamplingTensors  # numpy arrays and the sampler's static switches
    feed_index: np.ndarray  # int32[T]
    num_tokens: int  # tokens before padding
    num_context_tokens: int
    # Only in steps where some row asks for logits or post-processing (see
    # jaxllm.engine.logits_outputs); None / () in a plain step.
    context_index: Optional[np.ndarray] = None  # int32[E] packed tokens whose logits come back
    logits_rows: Optional[np.ndarray] = None  # int32[R] rows whose raw logits come back
    processor_rows: Optional[np.ndarray] = None  # int32[R] rows rewritten by host processors
    batched_processors: tuple = ()  # (name, request ids int32[S], mask bool[S]) per device processor
    # (batch, feed_index) already laid out as `host_transfer.pack` packs them, when the plan
    # was built in that buffer (a steady decode step; its fields are views of it).
    packed_forward: Optional[np.ndarray] = None
    # Every row decodes greedily with no penalties, suppression or logprobs: the runner takes
    # each row's token from the forward's argmax and runs no sampler.
    greedy_only: bool = False

    @property
    def has_logits_work(self) -> bool:
        return self.logits_rows is not None or self.processor_rows is not None or bool(self.batched_processors)


@dataclass(frozen=True)
class PlannerOptions:
    """How the engine wants one step planned (given to `schedule`, kept for that step)."""

    # A beam-search request is active: its generation steps run one row per beam (`expand_beams`).
    beam_search: bool = False
    # Steady decode steps keep their tokens in a `DecodeTokenLog`, whose owner reads them back
    # into it (off for a caller that writes tokens over placeholders itself, and while a
    # request needs its tokens on the host each step: logits outputs, logprobs, penalties, beams).
    defer_tokens: bool = False
    # num_tokens -> the token bucket a step runs in (None: the smallest that holds them); set to
    # run in a compiled bucket while the best fit compiles (`jaxllm.engine.compile_ahead`).
    choose_bucket: Optional[Callable[[int], int]] = None
    # The same for a step in which a request asks for its prompt's logits: a bucket whose
    # context-logits forward is compiled (`jaxllm.engine.context_logits_variants`).
    choose_context_bucket: Optional[Callable[[int], int]] = None
    # Decode-only steps run in the small decode buckets (`Planner.decode_batch_sizes`; off while
    # rows ask for logits outputs or post-processors, whose programs take max_batch_size rows).
    # `choose_decode_rows(rows)`: the decode bucket, None for a token bucket (None: the smallest
    # holding them); set while some compile.
    decode_buckets: bool = True
    choose_decode_rows: Optional[Callable[[int], Optional[int]]] = None
