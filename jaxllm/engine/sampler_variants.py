"""Which sampler program a step runs while the variant it needs is not compiled.

The sampler compiles once per variant of its static switches (`SamplingTensors`) and per
number of rows (`max_batch_size` for the token buckets, each small decode bucket's own). The
first request with a new setting (top-p, a penalty, logprobs, a grammar) used to compile its
variant on the step, and every running stream waited for it. Instead the general variant
(`GENERAL_VARIANT`: every switch on) is compiled for each number of rows before a step of that
many rows can run: before "ready" for the token buckets and the one-row decode bucket
(`ProgramWarmup`), with its forward for the other decode buckets (`with_general_sampler`). A
step whose own variant is not compiled runs the general one over the same rows
(`SamplingTensors.generalized`), which samples the same tokens; its own variant compiles in the
background once the steps that ran the general one instead spent as much time as a compile
takes (rent or buy, as `jaxllm.engine.compile_ahead`), or when the engine is idle, on the
low-priority threads of `jaxllm.engine.background_compiles`, and steps use it once compiled.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, Optional

import jax

from jaxllm.engine.compile_ahead import StepClock
from jaxllm.engine.host_transfer import PackedLayout, pack
from jaxllm.engine.planner import StepPlan
from jaxllm.sampling import SamplingTensors

logger = logging.getLogger(__name__)

VariantKey = tuple[int, bool, int, bool, bool, bool]


def variant_key(t: SamplingTensors) -> VariantKey:
    """(rows, the static switches) of sampling tensors: what their compiled sampler depends on."""
    return (t.batch_size, t.use_penalties, t.num_top_logprobs, t.any_random, t.use_top_k_top_p, t.use_token_bitmask)


class SamplerVariants:
    """Chooses, per step, the compiled sampler variant (see the module docstring)."""

    def __init__(
        self,
        runner: Any,
        *,
        history_len: int,
        bitmask_words: int,
        compile_seconds: Callable[[], float],
    ) -> None:
        """`runner`: the `ModelRunner` whose programs run the steps; `history_len`, `bitmask_words`:
        the shapes the general variant's token history and grammar bitmask take;
        `compile_seconds()`: what one compile is expected to take."""
        self._runner = runner
        self.history_len = history_len
        self.bitmask_words = bitmask_words
        self._compile_seconds = compile_seconds
        self._clock = StepClock()
        self._lock = threading.Lock()
        self._layouts: dict[VariantKey, PackedLayout] = {}
        self._ready: set[VariantKey] = set()
        self._asked: dict[VariantKey, tuple[float, SamplingTensors]] = {}  # seconds paid, a template
        self._started: set[VariantKey] = set()
        self._closed = False
        self.general_steps = 0  # steps that ran the general variant in place of their own
        # Row counts a token bucket's sampler may run over (`Planner.sampler_row_sizes`).
        self.row_sizes: list[int] = []

    def general(self, rows: int) -> SamplingTensors:
        """All-padding tensors of the general variant for `rows` rows (to compile it)."""
        return SamplingTensors.empty(rows, self.history_len).generalized(self.history_len, self.bitmask_words)

    def choose(self, plan: StepPlan) -> StepPlan:
        """`plan`, or the same plan sampling with the general variant when its own is not
        compiled and the general one is (a step runs no compile for its sampler then)."""
        if plan.greedy_only and not plan.has_logits_work:  # no sampler runs
            return plan
        seconds = self._clock.tick()
        sampling = plan.sampling
        key = variant_key(sampling)
        if self._is_ready(key, sampling):
            return plan
        general = sampling.generalized(self.history_len, self.bitmask_words)
        if self._is_ready(variant_key(general), general):
            self.general_steps += 1
            self._pay(key, sampling, seconds)
            return replace(plan, sampling=general)
        # A token bucket's sampler over fewer rows than the forward's (`Planner.sampler_rows`):
        # padded to the next row count whose own or general variant is compiled.
        logits_rows = int(plan.batch.kv_lens.shape[-1])
        for rows in [r for r in self.row_sizes if sampling.batch_size < r < logits_rows] + [logits_rows]:
            if rows <= sampling.batch_size:
                break
            padded = sampling.padded(rows)
            if self._is_ready(variant_key(padded), padded):
                return replace(plan, sampling=padded)
            padded = padded.generalized(self.history_len, self.bitmask_words)
            if self._is_ready(variant_key(padded), padded):
                self.general_steps += 1
                self._pay(key, sampling, seconds)
                return replace(plan, sampling=padded)
        return plan  # nothing compiled ahead for these rows: the step compiles its variant

    def _is_ready(self, key: VariantKey, sampling: SamplingTensors) -> bool:
        if key in self._ready:
            return True
        if self._compiled(key, sampling):
            self._ready.add(key)
            return True
        return False

    def on_idle(self) -> None:
        """The engine has nothing to run: compile every variant steps asked for, and the general
        variant of each row count a token bucket's sampler may run over."""
        with self._lock:
            asked = [(key, template) for key, (_, template) in self._asked.items() if key not in self._started]
            self._asked.clear()
        for rows in self.row_sizes:
            general = self.general(rows)
            key = variant_key(general)
            if not self._is_ready(key, general) and key not in self._started:
                asked.append((key, general))
        for key, template in asked:
            self._start(key, template, idle=True)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._asked.clear()

    def with_general_sampler(self, forward: Future, rows: int, idle: bool) -> Future:
        """A future done once `forward` (the compile of a bucket of `rows` rows) and then the
        general sampler of `rows` rows are compiled: a bucket is used only with both."""
        done: Future = Future()

        def forward_done(f: Future) -> None:
            if f.cancelled() or f.exception() is not None:
                done.set_exception(f.exception() if not f.cancelled() else RuntimeError("cancelled"))
                return
            logits = _logits_struct(f.result())
            if logits is None:  # no output description (a loaded program): the step compiles it
                done.set_result(f.result())
                return
            sampler = self._runner.compile_sampler(logits, self.general(rows), wait=False, background=True, idle=idle)
            sampler.add_done_callback(
                lambda s: (
                    done.set_result(f.result())
                    if not s.cancelled() and s.exception() is None
                    else done.set_exception(s.exception() if not s.cancelled() else RuntimeError("cancelled"))
                )
            )

        forward.add_done_callback(forward_done)
        return done

    def _compiled(self, key: VariantKey, sampling: SamplingTensors) -> bool:
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = pack(sampling)[1]
        return self._runner.programs.has("sampler", layout)

    def _pay(self, key: VariantKey, sampling: SamplingTensors, seconds: float) -> None:
        with self._lock:
            if key in self._started or self._closed:
                return
            paid = self._asked.get(key, (0.0, sampling))[0] + seconds
            if paid < self._compile_seconds():
                self._asked[key] = (paid, sampling)
                return
            self._asked.pop(key, None)
        self._start(key, sampling, idle=False)

    def _start(self, key: VariantKey, template: SamplingTensors, idle: bool) -> None:
        logits = self.logits_struct(key[0])
        with self._lock:
            if key in self._started or self._closed or logits is None:
                return
            self._started.add(key)
        try:
            self._runner.compile_sampler(logits, template, wait=False, background=True, idle=idle)
        except Exception as exc:  # the general variant keeps serving these steps
            logger.debug("could not start compiling a sampler variant: %r", exc)

    def logits_struct(self, rows: int) -> Optional[jax.ShapeDtypeStruct]:
        """The logits a sampler of `rows` rows takes: a compiled forward's output of that many
        rows, or another's first `rows` rows (`Planner.sampler_rows`)."""
        other = None
        for exe in self._runner.programs.executables("forward").values():
            logits = _logits_struct(exe)
            if logits is not None and logits.shape[0] == rows:
                return logits
            other = other or logits
        if other is None or other.shape[0] < rows:
            return None
        return jax.ShapeDtypeStruct((rows, *other.shape[1:]), other.dtype, sharding=other.sharding)


def _logits_struct(exe: Any) -> Optional[jax.ShapeDtypeStruct]:
    """The logits output (shape, dtype, sharding) of a compiled forward, None when unknown."""
    try:
        info = exe.out_info[1]
        return jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=info.sharding)
    except Exception:  # a program without output information
        return None


def engine_sampler_variants(runner: Any, max_seq_len: int, vocab_size: int) -> SamplerVariants:
    """The sampler variants of an engine whose runner is `runner` (token histories of
    `max_seq_len` ids, grammar bitmasks over `vocab_size` tokens)."""
    return SamplerVariants(
        runner,
        history_len=max_seq_len,
        bitmask_words=(vocab_size + 31) // 32,
        compile_seconds=lambda: runner.compile_seconds / max(1, runner.num_compiled_variants),
    )
