"""Which programs an engine compiles, and when: before "ready" (`ProgramWarmup`), or ahead of
need in the background, with compiled stand-ins meanwhile (the token- and decode-bucket
compilers of `jaxllm.engine.compile_ahead`, the sampler variants of
`jaxllm.engine.sampler_variants`). Without compile-ahead everything compiles at warm-up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from jaxllm.engine.compile_ahead import BucketCompiler, engine_compilers
from jaxllm.engine.context_logits_variants import ContextLogitsVariants
from jaxllm.engine.engine_config import EngineConfig
from jaxllm.engine.sampler_variants import SamplerVariants, engine_sampler_variants
from jaxllm.engine.step_plan import PlannerOptions
from jaxllm.engine.warmup import ProgramWarmup


@dataclass
class EnginePrograms:
    warmup: ProgramWarmup
    sampler_variants: Optional[SamplerVariants]  # None: every variant compiles at warm-up
    bucket_compiler: Optional[BucketCompiler]  # None: every token bucket compiles at warm-up
    decode_compiler: Optional[BucketCompiler]  # None: no small decode buckets compiled ahead
    context_logits: Optional[ContextLogitsVariants] = None  # None: they compile on their first step

    def planner_options(self, requests: Any, token_log: bool) -> PlannerOptions:
        """How the next step is planned: in compiled buckets, given what the active `requests`
        (the engine's `RequestTable`) need; `token_log`: steady batches may log their tokens."""
        context, buckets, decode = self.context_logits, self.bucket_compiler, self.decode_compiler
        return PlannerOptions(
            beam_search=requests.num_beam_search > 0,
            # A steady batch keeps its tokens in a log unless a request needs them every step.
            defer_tokens=token_log and not requests.needs_host_tokens,
            choose_bucket=None if buckets is None else buckets.choose,
            choose_context_bucket=None if context is None else context.choose_bucket,
            # Logits outputs and post-processors take max_batch_size rows: token buckets only.
            decode_buckets=not requests.num_logits_requests,
            choose_decode_rows=None if decode is None else decode.choose_decode,
        )

    def token_budget(self, context_logits_pending: bool) -> Optional[int]:
        """A step's token cap (None: none): the largest compiled bucket while larger ones
        compile, and while a prompt asking for its logits runs, its bucket's variant too."""
        if self.bucket_compiler is None:
            return None
        cap = self.bucket_compiler.token_budget()
        if context_logits_pending and self.context_logits is not None:
            cap = self.context_logits.token_budget(cap)
        return cap

    def on_idle(self) -> None:
        """Compile, on the compile threads, what steps asked for and what warm-up left for later."""
        for compiler in (self.decode_compiler, self.bucket_compiler, self.sampler_variants):
            if compiler is not None:
                compiler.on_idle()

    def close(self) -> None:
        for compiler in (self.decode_compiler, self.bucket_compiler, self.sampler_variants):
            if compiler is not None:
                compiler.close()


def build_engine_programs(
    config: EngineConfig,
    *,
    planner: Any,
    step_runner: Any,
    runner: Any,
    num_sampler_rows: int,
    max_seq_len: int,
    vocab_size: int,
    logits_outputs: bool,
    compile_ahead: bool,
) -> EnginePrograms:
    """`step_runner` compiles and runs (the mirrored runner on a multi-host leader), `runner`
    says what a compile takes; `compile_ahead`: background compiles with stand-ins (not under
    attention DP, whose planner picks one bucket for all ranks, nor on a multi-host leader,
    whose followers compile on demand)."""
    variants = engine_sampler_variants(runner, max_seq_len, vocab_size) if compile_ahead else None
    bucket_compiler, decode_compiler = (
        engine_compilers(config, planner, step_runner, runner, variants) if compile_ahead else (None, None)
    )
    context_logits = (
        ContextLogitsVariants(
            step_runner=step_runner, runner=runner, planner=planner, bucket_compiler=bucket_compiler, config=config
        )
        if bucket_compiler is not None and logits_outputs
        else None
    )
    warmup = ProgramWarmup(
        runner=step_runner,
        planner=planner,
        config=config,
        num_sampler_rows=num_sampler_rows,
        max_seq_len=max_seq_len,
        bucket_compiler=bucket_compiler,
        logits_outputs=logits_outputs,
        attention_dp=config.enable_attention_dp,
        decode_compiler=decode_compiler,
        general_sampler=None if variants is None else variants.general,
        context_logits=context_logits,
    )
    return EnginePrograms(warmup, variants, bucket_compiler, decode_compiler, context_logits)
