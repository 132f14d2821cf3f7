"""Tensor-parallel equality of quantized checkpoints, all in one subprocess.

The quantized formats (AWQ, GGUF Q4_0, GGUF Q4_1) each prove that TP 2 gives the single-device
greedy tokens and holds the weight bytes `plan_memory` plans. One interpreter on 2 fake CPU
devices (`tests.multidevice`) builds an engine per (checkpoint, KV dtype, TP) of every case,
so the start-up, the imports and the programs the checkpoints share are paid once. Every
engine of the subprocess compiles with the same flags (`FAST_COMPILE`), so the tokens
compared within it stay comparable.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.multidevice import FAST_COMPILE, run_on_cpu_devices

PROMPTS = [[5, 17, 33, 2, 9, 41], [7, 7, 120, 64]]
MAX_TOKENS = 8
_CASES = "tp_cases.json"


def run_tp_engines(root: Path) -> None:
    """Subprocess entry point (2 devices): for each case of `root/tp_cases.json` ({name, path,
    kv_dtypes}), greedy tokens, planned and held weight bytes and the quantized weights'
    layout at TP 1 and TP 2, one JSON line per engine."""
    import jax

    from jaxllm import LLM, KvCacheConfig, SamplingParams
    from jaxllm.bench.quant import held_weight_bytes
    from jaxllm.models.memory_plan import plan_memory
    from jaxllm.models.quantization import QuantizedWeight
    from sharding.mesh import ParallelConfig

    for case in json.loads((root / _CASES).read_text()):
        for kv_dtype in case["kv_dtypes"]:
            for tp in (1, 2):
                llm = LLM(
                    case["path"],
                    dtype="float32",
                    tensor_parallel_size=tp,
                    max_batch_size=2,
                    max_seq_len=64,
                    kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=256, dtype=kv_dtype),
                    warmup="none",  # greedy requests: they compile their two forwards and no sampler
                    dequantize_on_load=False,  # the kept quantized weights, split over the devices
                )
                outputs = llm.generate(
                    PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False
                )
                params = llm.engine.runner.params
                leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
                quantized = [w for w in leaves if isinstance(w, QuantizedWeight)]
                result = dict(
                    name=case["name"],
                    tp=tp,
                    kv=kv_dtype,
                    tokens=[list(o.outputs[0].token_ids) for o in outputs],
                    plan=plan_memory(llm.engine.model_config, ParallelConfig(tp)).weights_per_device,
                    held=held_weight_bytes(params),
                    num_quantized=len(quantized),
                    all_packed=all(w.packed for w in quantized),
                    all_unsigned_with_offset=all(w.offset is not None and w.unsigned for w in quantized),
                )
                print(json.dumps(result), flush=True)
                llm.shutdown()


def tensor_parallel_runs(root: Path, cases: dict[str, tuple[Path, tuple[str, ...]]]) -> dict[str, list[dict]]:
    """Run every case ({name: (checkpoint directory, KV cache dtypes)}) at TP 1 and TP 2 in one
    subprocess; returns each case's engines' results (`run_tp_engines`)."""
    spec = [dict(name=name, path=str(path), kv_dtypes=list(kv)) for name, (path, kv) in cases.items()]
    (root / _CASES).write_text(json.dumps(spec))
    results = run_on_cpu_devices("quantized_tp", "run_tp_engines", root, num_devices=2, xla_flags=FAST_COMPILE)
    return {name: [r for r in results if r["name"] == name] for name in cases}


def assert_tp_equals_one_device(runs: list[dict], kv_dtypes: tuple[str, ...] = ("auto",)) -> None:
    """For each KV dtype: TP 2 gives the TP 1 tokens (MAX_TOKENS of each prompt), and each holds
    the weight bytes its plan gives, TP 2 fewer per device."""
    assert sorted({r["kv"] for r in runs}) == sorted(kv_dtypes), runs
    for kv in kv_dtypes:
        one, two = sorted((r for r in runs if r["kv"] == kv), key=lambda r: r["tp"])
        assert (one["tp"], two["tp"]) == (1, 2)
        assert len(one["tokens"]) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in one["tokens"])
        assert two["tokens"] == one["tokens"], f"KV cache {kv}: TP 2 tokens differ from one device"
        assert one["plan"] == one["held"] and two["plan"] == two["held"] and two["held"] < one["held"]
