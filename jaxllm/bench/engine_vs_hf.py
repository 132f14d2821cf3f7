"""Output tokens/s of `LLM.generate` next to Hugging Face on the same weights and requests,
cold and warm.

HF runs with static padded batching (`generate`: left padding, every sequence in a batch
decodes until the longest request is done) and, where the installed transformers has it,
with its continuous batching (`generate_batch`'s manager, one output length per request),
torch on CPU; jaxllm runs the same requests with in-flight batching. All decode greedily
with EOS ignored, so each request yields exactly its output length, and only those tokens
are counted.

Cold is the first call of a fresh engine, compilation included, with an empty compilation
cache (the run points JAX's persistent cache at a new temporary directory). `LLM(...)` compiles
the decode token bucket and the one-row decode bucket before it returns (its default background warm-up), so
the table also shows "build + cold": the engine build (weights, KV cache, those compiles) plus
the first call, next to HF's model load plus its first call. During the cold call steps run in a
compiled token bucket while better-fitting ones compile once they pay for themselves
(`jaxllm.engine.compile_ahead`); warm is the same call again once everything is compiled
(jaxllm warms up every bucket in between), `--warm-runs` times for every engine, and the
table shows the median run (all warm runs are listed below it).
Also reports the host time per engine step and its share of the step.

    jaxllm bench engine --model tiny-moe --num-requests 64 --input-len 8 192 --output-len 8 96
    jaxllm bench engine --model qwen3-moe-100m --num-requests 64
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

# A ~100M-parameter Qwen3-MoE-shaped random model (built with transformers on demand).
QWEN3_MOE_100M = dict(
    vocab_size=32000,
    hidden_size=512,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_experts=32,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def _model_dir(name: str, work: Path) -> Path:
    from jaxllm.models import is_preset, materialize_preset

    if is_preset(name):
        return materialize_preset(name)
    if name != "qwen3-moe-100m":
        from jaxllm.models.resolve import resolve_model

        return resolve_model(name)  # a directory, or a downloadable name such as smollm2
    import shutil

    import torch
    import transformers

    path = work / name
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3_MOE_100M)).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer_dir = materialize_preset("tiny-moe")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, path / f)
    return path


def _workload(num: int, vocab: int, seed: int, in_range: tuple[int, int], out_range: tuple[int, int]):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, size=int(rng.integers(*in_range))).tolist() for _ in range(num)]
    outputs = [int(rng.integers(*out_range)) for _ in range(num)]
    return prompts, outputs


def _result(seconds: float, tokens: int, **extra) -> dict:
    return dict(seconds=seconds, tokens=tokens, tok_per_s=tokens / seconds, **extra)


def _median_run(runs: list[dict]) -> dict:
    """The median of repeated runs (by time), carrying every run's seconds."""
    ordered = sorted(runs, key=lambda r: r["seconds"])
    return {**ordered[(len(ordered) - 1) // 2], "all_seconds": [r["seconds"] for r in runs]}


def run_jaxllm(model_dir: Path, prompts, out_lens, args, compile_cache_dir: str) -> dict:
    """{'cold': first generate of a fresh engine with an empty compilation cache, 'warm': again}."""
    import jax

    from jaxllm import LLM, KvCacheConfig, SamplingParams

    # An empty persistent cache for this process (engines keep a directory already set).
    jax.config.update("jax_compilation_cache_dir", compile_cache_dir)
    build_start = time.perf_counter()
    llm = LLM(
        str(model_dir),
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        max_seq_len=args.max_seq_len,
        kv_cache_config=KvCacheConfig(tokens_per_block=32),
    )
    build_seconds = time.perf_counter() - build_start
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in out_lens]
    results = {}
    build = llm.executor.call_on_engine(
        lambda e: dict(
            compile_seconds=e.runner.compile_seconds,
            forwards=e.runner.num_forward_variants,
            samplers=e.runner.num_sampler_variants,
            wait=e.runner.compile_wait_seconds,
        )
    )
    warm_runs = []
    for phase in ("cold",) + ("warm",) * args.warm_runs:
        if phase == "warm" and not warm_runs:
            llm.executor.call_on_engine(lambda engine: engine.warmup(), timeout=None)  # every bucket compiled
        llm.executor.call_on_engine(lambda engine: engine.reset_timing())
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        timing = llm.executor.call_on_engine(lambda engine: engine.timing)
        result = _result(
            elapsed,
            sum(len(o.outputs[0].token_ids) for o in outs),
            steps=timing.steps,
            host_ms_per_step=1e3 * timing.host_seconds / max(timing.steps, 1),
            host_share=timing.host_seconds / max(timing.host_seconds + timing.device_wait_seconds, 1e-9),
        )
        if phase == "warm":
            warm_runs.append(result)
            results["warm"] = _median_run(warm_runs)
        else:
            results[phase] = result
        if phase == "cold":  # what compiled during the call itself (the build's compiles apart)
            results[phase].update(
                llm.executor.call_on_engine(
                    lambda e: dict(
                        compile_seconds=e.runner.compile_seconds - build["compile_seconds"],
                        compile_wait_seconds=e.runner.compile_wait_seconds - build["wait"],
                        forwards_compiled=e.runner.num_forward_variants - build["forwards"],
                        samplers_compiled=e.runner.num_sampler_variants - build["samplers"],
                        padded_steps=e.bucket_compiler.padded_steps if e.bucket_compiler is not None else 0,
                    )
                )
            )
    results["build_seconds"] = build_seconds
    results["build_compiles"] = build
    llm.shutdown()
    return results


def _hf_model(model_dir: Path, args):
    """(the HF model, seconds it took to load)."""
    start = time.perf_counter()
    import torch
    import transformers

    torch.set_num_threads(args.torch_threads or torch.get_num_threads())
    dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    from jaxllm.bench.hf_checkpoint import float_checkpoint

    hf_dir = float_checkpoint(model_dir)[0]  # an integer checkpoint's float weights
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype or "auto").eval()
    return model, time.perf_counter() - start


def run_hf(model, prompts, out_lens, args) -> dict:
    """HF `generate` over static batches of `--hf-batch-size` requests."""
    import torch

    start = time.perf_counter()
    generated = 0
    for i in range(0, len(prompts), args.hf_batch_size):
        batch, lens = prompts[i : i + args.hf_batch_size], out_lens[i : i + args.hf_batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(lens),
                min_new_tokens=max(lens),
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == width + max(lens)
        generated += sum(lens)
    return _result(time.perf_counter() - start, generated)


def hf_continuous_batching_available(model) -> bool:
    return hasattr(model, "continuous_batching_context_manager")


def run_hf_continuous(model, prompts, out_lens, args) -> dict:
    """HF continuous batching (the manager behind `generate_batch`), each request with its own
    output length; EOS is an id the model cannot produce, so every request runs to its length."""
    import transformers

    config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=max(out_lens), eos_token_id=model.config.vocab_size, pad_token_id=0
    )
    start = time.perf_counter()
    generated = 0
    with model.continuous_batching_context_manager(generation_config=config, block=True) as manager:
        ids = [
            manager.add_request(p, max_new_tokens=n, eos_token_id=model.config.vocab_size)
            for p, n in zip(prompts, out_lens)
        ]
        pending = set(ids)
        while pending:
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished() and result.request_id in pending:
                pending.discard(result.request_id)
                generated += len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("HF continuous batching stopped before finishing the requests")
    return _result(time.perf_counter() - start, generated)


def main(argv: list[str] | None = None) -> int:
    from jaxllm.cli.args import HelpFormatter

    parser = argparse.ArgumentParser(prog="jaxllm bench engine", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--model", default="tiny-moe", help="preset, smollm2, HF dir, or qwen3-moe-100m (random, built on demand)"
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-num-tokens", type=int, default=1024)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--warm-runs", type=int, default=3, help="warm calls per engine; the table shows the median")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-hf-continuous", action="store_true", help="skip HF continuous batching")
    parser.add_argument("--report-json", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.warm_runs < 1:
        parser.error("--warm-runs must be at least 1")
    load_start = os.getloadavg()[0]

    with tempfile.TemporaryDirectory() as work:
        model_dir = _model_dir(args.model, Path(work))
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        prompts, out_lens = _workload(
            args.num_requests,
            vocab,
            args.seed,
            (args.input_len[0], args.input_len[1] + 1),
            (args.output_len[0], args.output_len[1] + 1),
        )
        with tempfile.TemporaryDirectory() as compile_cache_dir:
            ours = run_jaxllm(model_dir, prompts, out_lens, args, compile_cache_dir)
        rows = {"jaxllm LLM.generate": ours}
        if not args.skip_hf:
            model, hf_load_seconds = _hf_model(model_dir, args)
            rows["HF generate (static batch)"] = {
                "cold": run_hf(model, prompts, out_lens, args),
                "warm": _median_run([run_hf(model, prompts, out_lens, args) for _ in range(args.warm_runs)]),
            }
            rows["HF generate (static batch)"]["build_seconds"] = hf_load_seconds
            if hf_continuous_batching_available(model) and not args.skip_hf_continuous:
                rows["HF continuous batching"] = {
                    "cold": run_hf_continuous(model, prompts, out_lens, args),
                    "warm": _median_run(
                        [run_hf_continuous(model, prompts, out_lens, args) for _ in range(args.warm_runs)]
                    ),
                }

    print(
        f"\nmodel={args.model} requests={args.num_requests} input={args.input_len} output={args.output_len} "
        f"dtype={args.dtype}"
    )
    static = rows.get("HF generate (static batch)")
    print(f"{'engine':<28}{'run':<6}{'seconds':>9}{'out tokens':>12}{'tok/s':>9}{'x HF static':>12}")
    for name, phases in rows.items():
        for phase in ("cold", "warm"):
            r = phases[phase]
            ratio = f"{r['tok_per_s'] / static[phase]['tok_per_s']:.2f}x" if static else "-"
            print(f"{name:<28}{phase:<6}{r['seconds']:>9.2f}{r['tokens']:>12}{r['tok_per_s']:>9.1f}{ratio:>12}")
    for name, phases in rows.items():  # build (or model load) + cold call, where measured
        if "build_seconds" in phases:
            total = phases["build_seconds"] + phases["cold"]["seconds"]
            ratio = "-"
            if static and "build_seconds" in static:
                ratio = f"{(static['build_seconds'] + static['cold']['seconds']) / total:.2f}x"
            tokens = phases["cold"]["tokens"]
            print(f"{name:<28}{'build':<6}{phases['build_seconds']:>9.2f}{'':>12}{'':>9}{'':>12}")
            print(f"{name:<28}{'b+cold':<6}{total:>9.2f}{tokens:>12}{tokens / total:>9.1f}{ratio:>12}")
    for name, phases in rows.items():
        print(f"{name} warm runs (s): " + ", ".join(f"{t:.2f}" for t in phases["warm"]["all_seconds"]))
    print(
        "cold: first call of a fresh engine, compilation included, empty compilation cache; warm: the same "
        f"call again, median of {args.warm_runs}; build: LLM(...) (weights, KV cache, the warm-up's compiles) "
        "or HF from_pretrained; "
        "b+cold: build + cold call (x HF static: against HF static batching in the same run; for b+cold "
        "the ratio of total times)"
    )
    cold, built = ours["cold"], ours["build_compiles"]
    print(
        f"jaxllm: engine built in {ours['build_seconds']:.1f} s ({built['forwards']} token buckets + "
        f"{built['samplers']} sampler compiled, {built['compile_seconds']:.1f} s compiling); cold call: steps "
        f"waited {cold['compile_wait_seconds']:.1f} s for compiles ({cold['compile_seconds']:.1f} s compiling in "
        f"all threads, {cold['forwards_compiled']} more token buckets and {cold['samplers_compiled']} sampler "
        f"variants compiled by its end, {cold['padded_steps']} steps run in a larger compiled bucket meanwhile)"
    )
    print(f"load average (1 min) at start {load_start:.1f}, at end {os.getloadavg()[0]:.1f}")
    warm = ours["warm"]
    print(
        f"engine steps (warm): {warm['steps']}, host time per step: {warm['host_ms_per_step']:.2f} ms, "
        f"host share of step time: {100 * warm['host_share']:.1f}%"
    )
    if args.report_json:
        Path(args.report_json).write_text(json.dumps({**rows, "args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
