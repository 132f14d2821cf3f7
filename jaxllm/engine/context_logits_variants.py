"""Which context-logits forwards are compiled, and the stand-in a step runs while its own is not.

A step in which a request asks for its prompt's logits (`prompt_logprobs`,
`return_context_logits`) runs its token bucket's forward variant that also returns E rows of
logits (`jaxllm.engine.logits_outputs`, E a bucket >= the tokens asked for). Most runs use none
of the (bucket, E) pairs, so they are not compiled before "ready" except one: the *full*
variant (E = the bucket) of the largest bucket the warm-up compiled, which serves any step
that bucket holds. While a request asking for context logits is active:

* a step is held to the largest bucket whose full variant is compiled (`token_budget`), and
  runs in the smallest such bucket holding its tokens (`choose_bucket`);
* it takes its best-fitting E if that variant is compiled, else its bucket's full variant
  (`choose_rows`; the extra rows repeat a real one and are not read);
* the best fits compile in the background meanwhile (low priority, as the other stand-ins').

So no step waits for a context-logits compile after "ready", and each asked row's logits are
its own whichever variant ran (a larger bucket pads the step, which changes only the float
rounding of its matmuls, as batching with other requests does).
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import numpy as np

from jaxllm.batch_builder import choose_token_bucket
from jaxllm.engine.host_transfer import pack


class ContextLogitsVariants:
    def __init__(self, *, step_runner: Any, runner: Any, planner: Any, bucket_compiler: Any, config: Any) -> None:
        """`step_runner` compiles (the engine's runner: compile-ahead is single-process), `runner`
        holds the compiled programs; `bucket_compiler` picks a plain step's bucket."""
        self.step_runner, self.runner, self.planner = step_runner, runner, planner
        self.bucket_compiler = bucket_compiler
        self.max_num_tokens, self.min_token_bucket = config.max_num_tokens, config.min_token_bucket
        self._layouts: dict[tuple[int, int], Any] = {}
        self._wanted: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self.stand_in_steps = 0  # steps that ran a larger bucket or E than their best fit

    def _inputs(self, bucket: int, rows: int) -> tuple:
        batch, feed_index = self.planner.empty_step(bucket)
        return batch, feed_index, np.zeros(rows, np.int32)

    def _layout(self, bucket: int, rows: int) -> Any:
        key = (bucket, rows)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = pack(self._inputs(bucket, rows))[1]
        return layout

    def compiled(self, bucket: int, rows: Optional[int] = None) -> bool:
        """Whether the variant of `bucket` with `rows` context rows (default: full) is compiled."""
        return self.runner.programs.has("forward", self._layout(bucket, bucket if rows is None else rows))

    def compile(self, bucket: int, rows: Optional[int] = None, *, background: bool = False) -> Any:
        """Start compiling a variant (default: the full one); returns its future."""
        inputs = self._inputs(bucket, bucket if rows is None else rows)
        return self.step_runner.compile_forward(*inputs, wait=False, background=background)

    def _full_buckets(self) -> list[int]:
        return [bucket for bucket in self.planner.token_buckets() if self.compiled(bucket)]

    def token_budget(self, cap: Optional[int]) -> Optional[int]:
        """The step's token cap while context logits are asked for: `cap` (the plain steps'),
        at most the largest bucket whose full variant is compiled."""
        full = self._full_buckets()
        if not full:
            return cap
        largest = choose_token_bucket(self.max_num_tokens, self.max_num_tokens, self.min_token_bucket)
        if full[-1] >= largest:
            return cap
        return full[-1] if cap is None else min(cap, full[-1])

    def choose_bucket(self, num_tokens: int) -> int:
        """The bucket of a step of `num_tokens` tokens in which a request asks for context logits."""
        exact = choose_token_bucket(num_tokens, self.max_num_tokens, self.min_token_bucket)
        if not self.compiled(exact):
            self._want(exact, exact)
        fits = [bucket for bucket in self._full_buckets() if bucket >= num_tokens]
        if not fits:  # nothing compiled ahead (no warm-up): the step compiles its own
            return self.bucket_compiler.choose(num_tokens)
        if fits[0] != exact:
            self.stand_in_steps += 1
        return fits[0]

    def choose_rows(self, bucket: int, count: int) -> int:
        """The context rows E of a step in `bucket` asking for `count` rows' logits."""
        best = choose_token_bucket(count, bucket, self.min_token_bucket)
        if self.compiled(bucket, best) or not self.compiled(bucket):
            return best
        self._want(bucket, best)
        self.stand_in_steps += 1
        return bucket

    def _want(self, bucket: int, rows: int) -> None:
        with self._lock:
            if (bucket, rows) in self._wanted:
                return
            self._wanted.add((bucket, rows))
        self.compile(bucket, rows, background=True)
