"""Quantized weights and KV cache next to the float model (`jaxllm bench quant`): weight
bytes on the device, KV cache bytes per token, teacher-forced top-1 agreement with the float
model, and decode tokens/s.

Engines on the same checkpoint: the float model (`dtype="auto"`: float32 on CPU), the same
in bfloat16, FP8 weights with float activations (`fp8_activation_scheme="none"`) and with
dynamic per-token-group FP8 activations (the default), weight-only int8 and int4 with one
scale per 32 inputs (GGUF's Q8_0 / Q4_0 blocks, `quantization="int8"` / `"int4"`), and the
float model with an FP8 KV cache (`KvCacheConfig(dtype="fp8")`, scales 1.0, and computed
from a calibration prefill, `calculate_kv_scales=True`). A checkpoint stored with integer
weights (a GGUF file such as smollm2's Q4_1, AWQ, GPTQ) adds the row "as stored", its weights
kept in their own format; the float model is then its dequantized weights (written once to
a float checkpoint beside the bench's cache), which the other rows quantize again. Agreement: each
engine's context logits over one fixed English passage, argmax compared position by position
with the float model's. Bytes: every array the engine holds as weights (quantized values and
scales included), on the most loaded device. Speed is a GPU figure; on CPU the
quantized rows also pay for dequantizing inside the step.

    jaxllm bench quant --model smollm2
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

PASSAGE = (
    "A river begins as rain on the hills. The water gathers in small streams that run between the "
    "rocks, and the streams join into a larger channel that cuts through the valley. Over many years "
    "the river carries sand and stones down to the plain, where it slows, spreads out and drops what "
    "it carried. Farmers settle along its banks because the soil there is rich and the water is close. "
    "Towns grow at the places where the river can be crossed, and roads meet at the bridges. When the "
    "river floods, the people who live beside it move their animals to higher ground and wait for the "
    "water to fall again. In the dry months the river shrinks to a thin line of water between wide "
    "banks of pale gravel, and children walk across it to reach the fields on the other side."
)
# (row, dtype, quantization, fp8_activation_scheme, KV cache dtype, computed KV scales)
VARIANTS = (
    ("float", "auto", None, "dynamic", "auto", False),
    ("as stored", "auto", None, "dynamic", "auto", False),
    ("bfloat16", "bfloat16", None, "dynamic", "auto", False),
    ("fp8 weights-only", "auto", "fp8", "none", "auto", False),
    ("fp8 dynamic", "auto", "fp8", "dynamic", "auto", False),
    ("int8 (Q8_0)", "auto", "int8", "none", "auto", False),
    ("int4 (Q4_0)", "auto", "int4", "none", "auto", False),
    ("fp8 KV cache", "auto", None, "dynamic", "fp8", False),
    ("fp8 KV computed", "auto", None, "dynamic", "fp8", True),
)


def checkpoints(model: str) -> tuple[str, Any]:
    """(the float checkpoint the rows start from, the integer-quantized one as stored or None)."""
    from jaxllm.bench.hf_checkpoint import float_checkpoint
    from jaxllm.models.resolve import resolve_model

    float_dir, label = float_checkpoint(model)
    return str(float_dir), None if label is None else (str(resolve_model(model)), label)


def held_weight_bytes(params: Any) -> int:
    """Bytes of weights on the most loaded device (slot tables and LoRA slots left out)."""
    import jax

    per_device: dict = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
        if "slots" in keys or "lora" in keys:
            continue
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


def run_variant(
    model: str, args: argparse.Namespace, dtype: str, quantization: Any, scheme: str, kv_dtype: str, computed: bool
) -> dict:
    from jaxllm import LLM, KvCacheConfig, SamplingParams
    from jaxllm.models import kv_cache_bytes_per_token

    llm = LLM(
        model,
        dtype=dtype,
        quantization=quantization,
        fp8_activation_scheme=scheme,
        kv_cache_config=KvCacheConfig(dtype=kv_dtype, calculate_kv_scales=computed),
        max_batch_size=args.batch,
        max_num_tokens=512,
        max_seq_len=512,
        warmup_logits_outputs=True,
        dequantize_on_load=False,  # "as stored": an integer checkpoint's weights kept in their own format
    )
    try:
        nbytes = llm.executor.call_on_engine(lambda e: held_weight_bytes(e.runner.params))
        kv_bytes = llm.executor.call_on_engine(lambda e: kv_cache_bytes_per_token(e.model_config))
        ids = llm.tokenizer.encode(PASSAGE)[: args.passage_tokens]
        out = llm.generate(
            [ids], SamplingParams(max_tokens=1, temperature=0, return_context_logits=True), use_tqdm=False
        )
        logits = np.asarray(out[0].context_logits)
        prompts = [ids[i * 7 : i * 7 + 16] for i in range(args.batch)]
        params = SamplingParams(max_tokens=args.decode_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)  # warm every decode bucket
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    finally:
        llm.shutdown()
    return dict(bytes=nbytes, kv=kv_bytes, top1=logits.argmax(-1), tok_s=tokens / seconds)


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(
        prog="jaxllm bench quant", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--passage-tokens", type=int, default=256, help="teacher-forced positions compared")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument(
        "--rows",
        nargs="+",
        choices=[v[0] for v in VARIANTS],
        default=None,
        help="only these rows (and the float one they are compared with)",
    )
    args = parser.parse_args(argv)
    chosen = [v for v in VARIANTS if args.rows is None or v[0] in args.rows]
    if not any(v[0] == "float" for v in chosen):
        chosen.insert(0, VARIANTS[0])
    float_model, stored = checkpoints(args.model)
    rows = {}
    for name, *rest in chosen:
        if name == "as stored":
            if stored is None:
                continue
            rows[f"as stored ({stored[1]})"] = run_variant(stored[0], args, *rest)
        else:
            rows[name] = run_variant(float_model, args, *rest)
    base = rows["float"]
    print(
        f"model {args.model}: {len(base['top1'])} teacher-forced positions, {args.batch} x {args.decode_tokens} decode"
    )
    print(
        f"{'variant':<18}{'weights MiB':>12}{'x float':>9}{'KV B/token':>12}{'x float':>9}"
        f"{'top-1 = float':>15}{'decode tok/s':>14}{'x float':>9}"
    )
    for name, r in rows.items():
        agree = float(np.mean(r["top1"] == base["top1"]))
        print(
            f"{name:<18}{r['bytes'] / 2**20:>12.1f}{r['bytes'] / base['bytes']:>9.3f}{r['kv']:>12,}"
            f"{r['kv'] / base['kv']:>9.3f}{agree:>15.3f}{r['tok_s']:>14.1f}{r['tok_s'] / base['tok_s']:>9.2f}"
        )
    return 0
