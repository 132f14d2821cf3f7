"""The plain-XLA kernels the engine runs off-GPU (the `xla` backends) next to their references, at
the shapes of a model's decode and prefill steps: CPU time per call and compile time.

Attention: the work-list kernel (`pallas_kernels/ragged_paged_attention/tiled_xla.py`) against
the reference's per-token walk over KV blocks. MoE: the tiled grouped FFN against
`jax.lax.ragged_dot`. Greedy sampling's argmax: the sampler's blocked `first_argmax` against
`jnp.argmax` (XLA:CPU's scalar (value, index) reduction) over `--batch` rows of the vocabulary.
Inputs are random: decode steps of `--batch` sequences with KV lengths
drawn from `--kv-len`, prefill steps of `--tokens` tokens split into prompts of `--prompt-len`.
CPU time (process time over all threads) is reported, so figures hold on a busy machine better
than wall time. Run: `jaxllm bench xla-kernels --model tiny-moe`.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

# (q heads, kv heads, head_dim, hidden, moe intermediate, experts, top_k) of the built-in shapes.
SHAPES = {
    "tiny-moe": (4, 2, 32, 128, 64, 8, 2),
    "smollm2": (9, 3, 64, 576, 0, 0, 0),
}
VOCAB = {"tiny-moe": 453, "smollm2": 49152}


@dataclass
class Row:
    kernel: str
    case: str
    impl: str
    cpu_ms: float
    compile_s: float
    max_err: float


def _time_cpu(fn: Callable, args: tuple, iters: int, reps: int) -> float:
    out = fn(*args)
    out.block_until_ready()
    best = float("inf")
    for _ in range(reps):
        start = time.process_time()
        for _ in range(iters):
            out = fn(*args)
        out.block_until_ready()
        best = min(best, (time.process_time() - start) / iters)
    return best


def _run(kernel: str, case: str, impls: dict[str, Callable], args: tuple, iters: int, reps: int) -> list[Row]:
    import jax
    import numpy as np

    rows, want = [], None
    for impl, fn in impls.items():
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        compile_s = time.perf_counter() - start
        out = np.asarray(compiled(*args), np.float32)
        want = out if want is None else want
        rows.append(
            Row(
                kernel,
                case,
                impl,
                _time_cpu(compiled, args, iters, reps) * 1e3,
                compile_s,
                float(np.abs(out - want).max()),
            )
        )
    return rows


def attention_inputs(
    rng,
    *,
    decode: bool,
    tokens: int,
    batch: int,
    heads: tuple[int, int, int],
    tpb: int,
    max_seq_len: int,
    kv_len: tuple[int, int],
    prompt_len: tuple[int, int],
):
    import jax.numpy as jnp
    import numpy as np

    hq, hkv, d = heads
    max_blocks = -(-max_seq_len // tpb)
    num_blocks = batch * max_blocks + 1
    if decode:
        q_lens = np.ones(batch, np.int32)
        kv = rng.integers(kv_len[0], kv_len[1] + 1, batch).astype(np.int32)
    else:
        q_lens, left = np.zeros(batch, np.int32), tokens
        for i, n in enumerate(rng.integers(prompt_len[0], prompt_len[1] + 1, batch)):
            q_lens[i] = min(int(n), left)
            left -= q_lens[i]
        kv = q_lens.copy()
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tables = (rng.permutation(num_blocks - 1)[: batch * max_blocks].reshape(batch, max_blocks) + 1).astype(np.int32)
    q = rng.standard_normal((tokens, hq, d), np.float32)
    k = rng.standard_normal((hkv, num_blocks, tpb, d), np.float32)
    v = rng.standard_normal((hkv, num_blocks, tpb, d), np.float32)
    return tuple(jnp.asarray(a) for a in (q, k, v, kv, tables, cu, np.array([int((q_lens > 0).sum())], np.int32)))


def moe_inputs(rng, *, tokens: int, hidden: int, inter: int, experts: int, top_k: int):
    import jax.numpy as jnp
    import numpy as np

    ids = rng.integers(0, experts, (tokens * top_k,))
    sizes = np.bincount(ids, minlength=experts).astype(np.int32)
    x = rng.standard_normal((tokens * top_k, hidden), np.float32)
    w = [
        rng.standard_normal(s, np.float32) * 0.05 for s in ((experts, hidden, inter),) * 2 + ((experts, inter, hidden),)
    ]
    return tuple(jnp.asarray(a) for a in (x, sizes, *w))


def main(argv: Optional[list[str]] = None) -> int:
    import jax.numpy as jnp
    import numpy as np

    from jaxllm.cli.args import HelpFormatter
    from jaxllm.sampling.sampler import first_argmax
    from pallas_kernels.moe_grouped_gemm.reference import moe_grouped_ffn_reference
    from pallas_kernels.moe_grouped_gemm.tiled_xla import moe_grouped_ffn_tiled
    from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
    from pallas_kernels.ragged_paged_attention.tiled_xla import ragged_paged_attention_tiled

    parser = argparse.ArgumentParser(
        prog="jaxllm bench xla-kernels", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--model", choices=sorted(SHAPES), default="tiny-moe", help="head and expert shapes")
    parser.add_argument("--batch", type=int, default=64, help="sequences per step")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of the prefill step")
    parser.add_argument("--kv-len", type=int, nargs=2, default=(8, 288), help="decode KV length range")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(8, 192), help="prefill prompt length range")
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3, help="timed loops, best reported")
    args = parser.parse_args(argv)

    hq, hkv, d, hidden, inter, experts, top_k = SHAPES[args.model]
    rng = np.random.default_rng(0)
    rows: list[Row] = []
    scale = d**-0.5
    attention = {
        "work list (xla backend)": functools.partial(ragged_paged_attention_tiled, sm_scale=scale),
        "reference walk": functools.partial(ragged_paged_attention_reference, sm_scale=scale),
    }
    for case, decode, tokens in (("decode", True, args.batch), ("prefill", False, args.tokens)):
        inputs = attention_inputs(
            rng,
            decode=decode,
            tokens=tokens,
            batch=args.batch,
            heads=(hq, hkv, d),
            tpb=args.tokens_per_block,
            max_seq_len=args.max_seq_len,
            kv_len=tuple(args.kv_len),
            prompt_len=tuple(args.prompt_len),
        )
        rows += _run("attention", f"{case} {tokens} tok", attention, inputs, args.iters, args.reps)
    if experts:
        moe = {"tiled (xla backend)": moe_grouped_ffn_tiled, "ragged_dot reference": moe_grouped_ffn_reference}
        for tokens in (args.batch, args.tokens):
            inputs = moe_inputs(rng, tokens=tokens, hidden=hidden, inter=inter, experts=experts, top_k=top_k)
            rows += _run("moe ffn", f"{tokens} tok x top{top_k}", moe, inputs, args.iters, args.reps)
    logits = (jnp.asarray(rng.standard_normal((args.batch, VOCAB[args.model]), np.float32)),)
    rows += _run(
        "argmax",
        f"{args.batch} x {VOCAB[args.model]}",
        {"blocked (sampler)": first_argmax, "jnp.argmax": lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32)},
        logits,
        args.iters,
        args.reps,
    )

    print(
        f"{args.model}: {hq} q / {hkv} kv heads, head_dim {d}, {args.tokens_per_block} tokens per block"
        + (f"; {experts} experts, hidden {hidden}, intermediate {inter}" if experts else "")
    )
    print(f"{'kernel':<10} {'case':<18} {'impl':<24} {'cpu ms':>8} {'compile s':>10} {'max err':>9}")
    for r in rows:
        print(f"{r.kernel:<10} {r.case:<18} {r.impl:<24} {r.cpu_ms:8.2f} {r.compile_s:10.2f} {r.max_err:9.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
