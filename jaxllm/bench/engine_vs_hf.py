"""Output tokens/s of `LLM.generate` next to Hugging Face `generate` on the same weights.

HF runs with static padded batching (left padding, every sequence in a batch decodes
until the longest request is done, torch on CPU); jaxllm runs the same requests with
in-flight batching. Both decode greedily with EOS ignored, so each request yields
exactly its output length, and only those tokens are counted. Also reports the host
time per engine step and its share of the step.

    jaxllm bench engine --model tiny-moe --num-requests 64
    jaxllm bench engine --model qwen3-moe-100m --num-requests 64
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

# A ~100M-parameter Qwen3-MoE-shaped random model (built with transformers on demand).
QWEN3_MOE_100M = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=64, intermediate_size=1024, moe_intermediate_size=256,
                      num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def _model_dir(name: str, work: Path) -> Path:
    from jaxllm.models import is_preset, materialize_preset

    if is_preset(name):
        return materialize_preset(name)
    if name != "qwen3-moe-100m":
        return Path(name)
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


def run_jaxllm(model_dir: Path, prompts, out_lens, args) -> dict:
    from jaxllm import LLM, KvCacheConfig, SamplingParams

    llm = LLM(str(model_dir), dtype=args.dtype, max_batch_size=args.max_batch_size,
              max_num_tokens=args.max_num_tokens, max_seq_len=args.max_seq_len,
              kv_cache_config=KvCacheConfig(tokens_per_block=32))
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in out_lens]
    llm.executor.call_on_engine(lambda engine: engine.warmup(), timeout=None)  # compile every bucket first
    llm.generate(prompts[: min(8, len(prompts))], params[:8], use_tqdm=False)
    llm.executor.call_on_engine(lambda engine: engine.reset_timing())
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    timing = llm.executor.call_on_engine(lambda engine: engine.timing)
    llm.shutdown()
    return dict(seconds=elapsed, tokens=generated, tok_per_s=generated / elapsed, steps=timing.steps,
                host_ms_per_step=1e3 * timing.host_seconds / max(timing.steps, 1),
                host_share=timing.host_seconds / max(timing.host_seconds + timing.device_wait_seconds, 1e-9))


def run_hf(model_dir: Path, prompts, out_lens, args) -> dict:
    import torch
    import transformers

    torch.set_num_threads(args.torch_threads or torch.get_num_threads())
    dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype or "auto").eval()
    start = time.perf_counter()
    generated = 0
    for i in range(0, len(prompts), args.hf_batch_size):
        batch, lens = prompts[i:i + args.hf_batch_size], out_lens[i:i + args.hf_batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens),
                                 min_new_tokens=max(lens), do_sample=False, pad_token_id=0)
        assert out.shape[1] == width + max(lens)
        generated += sum(lens)
    elapsed = time.perf_counter() - start
    return dict(seconds=elapsed, tokens=generated, tok_per_s=generated / elapsed)


def main(argv: list[str] | None = None) -> int:
    from jaxllm.cli import HelpFormatter

    parser = argparse.ArgumentParser(prog="jaxllm bench engine", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", default="tiny-moe", help="preset, HF dir, or qwen3-moe-100m")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--max-num-tokens", type=int, default=1024)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--report-json", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as work:
        model_dir = _model_dir(args.model, Path(work))
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        prompts, out_lens = _workload(args.num_requests, vocab, args.seed,
                                      (args.input_len[0], args.input_len[1] + 1),
                                      (args.output_len[0], args.output_len[1] + 1))
        ours = run_jaxllm(model_dir, prompts, out_lens, args)
        hf = None if args.skip_hf else run_hf(model_dir, prompts, out_lens, args)

    print(f"\nmodel={args.model} requests={args.num_requests} input={args.input_len} output={args.output_len} "
          f"dtype={args.dtype}")
    print(f"{'engine':<28}{'seconds':>10}{'out tokens':>12}{'tok/s':>10}")
    print(f"{'jaxllm LLM.generate':<28}{ours['seconds']:>10.2f}{ours['tokens']:>12}{ours['tok_per_s']:>10.1f}")
    if hf:
        print(f"{'HF generate (static batch)':<28}{hf['seconds']:>10.2f}{hf['tokens']:>12}{hf['tok_per_s']:>10.1f}")
        print(f"ratio jaxllm / HF: {ours['tok_per_s'] / hf['tok_per_s']:.2f}x")
    print(f"engine steps: {ours['steps']}, host time per step: {ours['host_ms_per_step']:.2f} ms, "
          f"host share of step time: {100 * ours['host_share']:.1f}%")
    if args.report_json:
        Path(args.report_json).write_text(json.dumps({"jaxllm": ours, "hf": hf, "args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
