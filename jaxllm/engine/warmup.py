"""Compiling before serving: which programs compile when, so that requests seldom wait.

`ProgramWarmup.run` compiles what a request can reach before the engine serves: the model
forward of every token bucket and of every small decode bucket (`EngineConfig.decode_batch_sizes`)
and the sampler of every variant of its static switches for each number of rows (or, in the
background mode, only the programs the first users need, the one-row decode bucket, the
decode token bucket, which holds a short prompt, and a prompt bucket of `FIRST_PREFILL_TOKENS`
tokens, with the general sampler for a few rows, leaving the rest to idle time and to the
rent-or-buy rule of `jaxllm.engine.compile_ahead`). The programs are lowered from all-padding
steps (`Planner.empty_step`), which write nothing to the KV cache. With the runner's fused
LM-head argmax (`ModelRunner.fused_argmax`) each of those forwards compiles with its
fused-argmax variant (what greedy-only steps run); the variant of a bucket left for later
compiles in idle time once a greedy step ran the full forward in its place.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import as_completed
from typing import Any, Optional

import jax
import numpy as np

from jaxllm.batch_builder import choose_token_bucket, token_buckets
from jaxllm.engine.compile_ahead import BucketCompiler
from jaxllm.engine.engine_config import EngineConfig
from jaxllm.engine.logits_outputs import row_buckets
from jaxllm.sampling import SAMPLER_VARIANTS, SamplingTensors

Progress = Optional[Callable[[int, int], None]]


class ProgramWarmup:
    """Compiles an engine's programs ahead of its first steps."""

    # The prompt tokens a step may hold after a background warm-up (`first_buckets`).
    FIRST_PREFILL_TOKENS = 256
    # A background warm-up compiles the general sampler for the sampler row counts up to this
    # (`Planner.sampler_rows`: a few users' steps); larger ones compile in idle time.
    FIRST_SAMPLER_ROWS = 2

    def __init__(
        self,
        *,
        runner: Any,
        planner: Any,
        config: EngineConfig,
        num_sampler_rows: int,
        max_seq_len: int,
        bucket_compiler: Optional[BucketCompiler],
        logits_outputs: bool,
        attention_dp: bool,
        decode_compiler: Optional[BucketCompiler] = None,
        general_sampler: Optional[Callable[[int], SamplingTensors]] = None,
        context_logits: Any = None,
    ) -> None:
        """`runner`: where programs compile and run (the mirrored runner on a multi-host
        leader); `logits_outputs`: whether requests may ask for logits (their programs are
        then compiled too, with `EngineConfig.warmup_logits_outputs`); `general_sampler(rows)`:
        the tensors of the general sampler variant, compiled for every number of rows a step
        compiled here can have (`jaxllm.engine.sampler_variants`; None: not compiled);
        `context_logits`: the context-logits variants compiled ahead (`ContextLogitsVariants`:
        the full variant of the largest bucket compiled here is, unless all of them are)."""
        self.runner = runner
        self.planner = planner
        self.config = config
        self.num_sampler_rows = num_sampler_rows
        self.max_seq_len = max_seq_len
        self.bucket_compiler = bucket_compiler
        self.decode_compiler = decode_compiler  # the small decode buckets' (None: none, or no compile-ahead)
        self.logits_supported = logits_outputs
        self.logits_outputs = logits_outputs and config.warmup_logits_outputs
        self.attention_dp = attention_dp
        self.general_sampler = general_sampler
        self.context_logits = context_logits if not self.logits_outputs else None

    def decode_bucket(self) -> int:
        """The token bucket every decoding step fits: the smallest holding `max_batch_size` tokens."""
        return choose_token_bucket(self.config.max_batch_size, self.config.max_num_tokens, self.config.min_token_bucket)

    def in_background(self, background: bool) -> bool:
        """Whether `run(background=background)` leaves buckets for later (it needs a bucket compiler)."""
        return background and self.bucket_compiler is not None

    def decode_sizes(self) -> list[int]:
        """The row counts of the small decode buckets (one compiled forward each)."""
        return list(self.planner.decode_batch_sizes)

    def fused(self) -> bool:
        """Whether each forward also compiles its fused-argmax variant (greedy-only steps')."""
        return bool(getattr(self.runner, "fused_argmax", False))

    def num_forwards(self) -> int:
        """Model forwards a full warm-up compiles: one per token bucket and per decode bucket,
        twice with the fused-argmax variants."""
        return (len(self.planner.token_buckets()) + len(self.decode_sizes())) * (1 + self.fused())

    def first_buckets(self) -> list[int]:
        """The token buckets a background warm-up compiles before returning: the decode bucket
        (every decode step fits it, and so does a short prompt), or the smallest holding a KV
        block when that is larger (steps are held to the compiled buckets, and a prompt chunk
        is whole blocks), and the one of `FIRST_PREFILL_TOKENS` (capped by max_num_tokens): the
        first requests' prompts run in chunks of the largest compiled bucket, and a chunk of a
        few dozen tokens costs about as much as one of hundreds (a CPU reads every weight
        per step), so without it the first burst of prompts took twice as long as later ones.
        With stall-free steps (`max_num_tokens_with_generation`) also the bucket holding such a
        step: a new prompt beside running streams would otherwise run its small chunks padded
        in the decode bucket, paying more than it would whole."""
        config = self.config
        tokens = max(config.max_batch_size, self.planner.kv_cache_manager.tokens_per_block)
        small = choose_token_bucket(tokens, config.max_num_tokens, config.min_token_bucket)
        prefill = choose_token_bucket(
            min(config.max_num_tokens, max(tokens, self.FIRST_PREFILL_TOKENS)),
            config.max_num_tokens,
            config.min_token_bucket,
        )
        buckets = {small, prefill}
        stall_free = config.tokens_with_generation()
        if stall_free is not None:
            buckets.add(choose_token_bucket(stall_free, config.max_num_tokens, config.min_token_bucket))
        return sorted(buckets)

    def first_decode_sizes(self) -> list[int]:
        """The decode buckets a background warm-up compiles before returning: the two smallest
        (one user decoding alone, and a second joining: without it their steps ran in the
        decode token bucket of `max_batch_size` rows, several times a one-row step)."""
        return self.decode_sizes()[:2] if self.decode_compiler is not None else []

    def num_pieces(self, all_variants: bool = True, background: bool = False) -> int:
        """The `total` that `run` reports to `progress`, known before anything compiles (a
        progress bar's length): one per forward and sampler variant (and context-logits
        variant) compiled before `run` returns."""
        general = self.general_sampler is not None
        context = int(self.context_logits is not None)  # one full context-logits variant
        if self.in_background(background):
            first = (len(self.first_buckets()) + len(self.first_decode_sizes())) * (1 + self.fused())
            return first + 1 + context
        buckets = self.planner.token_buckets()
        variants = (len(SAMPLER_VARIANTS) if all_variants else 1) + general
        rows = 1 + len(self.decode_sizes())
        return self.num_forwards() + variants * rows + len(self._logits_variants(buckets)) + context

    def _logits_variants(self, buckets: list[int]) -> list[tuple[int, int]]:
        """(bucket, rows) of every context-logits forward compiled ahead (none without logits outputs)."""
        if not self.logits_outputs:
            return []
        return [(bucket, rows) for bucket in buckets for rows in token_buckets(bucket, self.config.min_token_bucket)]

    def run(self, all_variants: bool = True, progress: Progress = None, background: bool = False) -> None:
        """Compile (see `LLMEngine.warmup`); `progress(done, total)` after each compiled piece,
        `total` being `num_pieces(all_variants, background)` throughout."""
        buckets = self.planner.token_buckets()
        variants = SAMPLER_VARIANTS if all_variants else [dict()]
        if self.in_background(background):
            self._in_background(buckets, progress)
        else:
            self._all(buckets, variants, progress, self.num_pieces(all_variants, background))

    def _samplings(self, rows: int, variants: Any) -> list[SamplingTensors]:
        """Empty sampling tensors of `rows` rows for each variant, and the general one."""
        samplings = [SamplingTensors.empty(rows, self.max_seq_len, **flags) for flags in variants]
        return samplings + ([self.general_sampler(rows)] if self.general_sampler is not None else [])

    def _all(self, buckets: list[int], variants: Any, progress: Progress, total: int) -> None:
        runner = self.runner
        batches = [self.planner.empty_step(bucket) for bucket in buckets]
        decode_batches = [self.planner.empty_step(0, rows) for rows in self.decode_sizes()]
        samplings = self._samplings(self.num_sampler_rows, variants)
        pending = [runner.compile_forward(*batch, wait=False) for batch in decode_batches + batches[1:]]
        if self.fused():
            pending += [runner.compile_forward(*b, wait=False, greedy=True) for b in decode_batches + batches]
        logits = runner.forward(*batches[0], None)  # compiled here, meanwhile the others on the threads
        runner.compile_batched_processors(logits)
        done = 1
        if progress is not None:
            progress(done, total)
        if self.logits_outputs:
            # The context-logits variant of every bucket, for every size of its extra output.
            batch_of = dict(zip(buckets, batches))
            pending += [
                runner.compile_forward(*batch_of[bucket], np.zeros(rows, np.int32), wait=False)
                for bucket, rows in self._logits_variants(buckets)
            ]
        if self.logits_supported:  # row gathers and scatters (generation logits, host processors)
            runner.compile_logits_programs(logits, row_buckets(self.num_sampler_rows))
        if self.context_logits is not None:  # any prompt asking for its logits runs in it
            pending.append(self.context_logits.compile(buckets[-1]))
        pending += [runner.compile_sampler(logits, sampling, wait=False) for sampling in samplings]
        done = self._wait(pending, done, progress, total)
        # The samplers of the decode buckets' logits [rows, V], from each one's forward (a
        # mirrored runner refers to a device array as its latest output).
        pending = []
        for rows, batch in zip(self.decode_sizes(), decode_batches):
            rows_logits = runner.forward(*batch, None)
            pending += [
                runner.compile_sampler(rows_logits, sampling, wait=False)
                for sampling in self._samplings(rows, variants)
            ]
        self._wait(pending, done, progress, total)
        if self.bucket_compiler is not None:
            self.bucket_compiler.mark_ready(buckets)
        if self.decode_compiler is not None:
            self.decode_compiler.mark_ready(self.decode_sizes())
        for batch in batches[1:] if not decode_batches else batches:  # the samplers take the latest
            logits = runner.forward(*batch, None)
        if self.planner.sampler_row_sizes:  # `Planner.sampler_rows`
            runner.compile_row_slices(logits, self.planner.sampler_row_sizes)
        outputs = [runner.sample(logits, sampling) for sampling in samplings]
        if not self.attention_dp:
            runner.copy_blocks([])  # beam search's copy on write (only padding: copies nothing)
        for out in outputs:
            np.asarray(out.token_ids)

    @staticmethod
    def _wait(pending: list, done: int, progress: Progress, total: int) -> int:
        """Wait for compiles, reporting each; returns the pieces done."""
        for future in as_completed(pending):
            future.result()
            done += 1
            if progress is not None:
                progress(done, total)
        return done

    def _in_background(self, buckets: list[int], progress: Progress) -> None:
        runner = self.runner
        first = self.first_buckets()
        first_rows = self.first_decode_sizes()
        steps = [self.planner.empty_step(0, rows) for rows in first_rows]
        steps += [self.planner.empty_step(bucket) for bucket in first]
        # They compile at once on the compile threads (on a CPU that is the build's cores, idle),
        # with the full context-logits variant of the largest (any prompt asking for its
        # logits runs in it until its own variant compiled in the background).
        futures = [runner.compile_forward(*step, wait=False) for step in steps]
        if self.fused():
            futures += [runner.compile_forward(*step, wait=False, greedy=True) for step in steps]
        if self.context_logits is not None:
            futures.append(self.context_logits.compile(first[-1]))
        for future in futures:
            future.result()
        generals = []
        for step in steps:  # each runs once (empty batches write nothing); a token bucket last
            logits = runner.forward(*step, None)
            if self.general_sampler is not None:  # any sampling setting runs without a compile
                rows = int(logits.shape[0])
                generals.append(runner.compile_sampler(logits, self.general_sampler(rows), wait=False))
        runner.compile_batched_processors(logits)
        # A token bucket's sampler runs over its live rows (`Planner.sampler_rows`): the slices,
        # and the general variant for the row counts a few users reach first.
        sizes = self.planner.sampler_row_sizes
        runner.compile_row_slices(logits, sizes)
        if self.general_sampler is not None:
            for rows in sizes:
                if rows <= self.FIRST_SAMPLER_ROWS and rows not in first_rows:
                    struct = jax.ShapeDtypeStruct((rows, *logits.shape[1:]), logits.dtype, sharding=logits.sharding)
                    generals.append(runner.compile_sampler(struct, self.general_sampler(rows), wait=False))
        greedy = SamplingTensors.empty(self.num_sampler_rows, self.max_seq_len)
        out = runner.sample(logits, greedy)
        for future in generals:
            future.result()
        runner.copy_blocks([])  # beam search's copy on write (only padding: copies nothing)
        np.asarray(out.token_ids)
        self.bucket_compiler.mark_ready(first)
        # The largest token bucket (which holds any step) first, then the smaller ones.
        rest = [bucket for bucket in buckets if bucket not in first]
        self.bucket_compiler.defer(rest[-1:] + rest[:-1])
        if self.decode_compiler is not None:
            self.decode_compiler.mark_ready(first_rows)
            self.decode_compiler.defer([rows for rows in self.decode_sizes() if rows not in first_rows])
        # Another sampler variant is not compiled ahead (most runs never use most variants): a
        # step that needs one runs the general variant while it compiles (sampler_variants).
        if self.logits_supported:  # cheap: generation logits and host processors compile nothing on a step
            runner.compile_logits_programs(logits, row_buckets(self.num_sampler_rows))
        if self.logits_outputs:
            for bucket in buckets:
                for rows in token_buckets(bucket, self.config.min_token_bucket):
                    runner.compile_forward(*self.planner.empty_step(bucket), np.zeros(rows, np.int32), wait=False)
        if progress is not None:
            total = len(steps) * (1 + self.fused()) + 1 + int(self.context_logits is not None)
            progress(total, total)
