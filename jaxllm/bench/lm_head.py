"""The LM head of a greedy-only step, fused argmax against full float32 logits (`jaxllm bench lm-head`).

Random weights (one final norm and LM head of `--hidden` x `--vocab`, bf16), rows of random
residuals; per row count two jitted programs side by side, on the same inputs:

* `full`: `decoder.compute_logits` then `first_argmax`, what a greedy step ran before
  (float32 logits [rows, V] written and read back);
* `fused`: `lm_head_argmax.greedy_tokens`, the argmax taken chunk by chunk inside the LM head.

Both are timed warm, interleaved `--repeat` times (the median reported), and checked to give the
same tokens. The table states the float32 logits bytes each writes (`logits_bytes`) and the time
ratio fused / full.

    jaxllm bench lm-head --vocab 128256 --hidden 256 --rows 64 256
"""

from __future__ import annotations

import argparse
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models.decoder import compute_logits
from jaxllm.models.lm_head_argmax import greedy_tokens, logits_bytes, vocab_chunk
from jaxllm.sampling.sampler import first_argmax


def _seconds(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def run(vocab: int, hidden: int, rows_list: list[int], repeat: int, tied: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    config = types.SimpleNamespace(tie_word_embeddings=tied, rms_norm_eps=1e-6, dtype="bfloat16")
    w = jnp.asarray(rng.standard_normal((vocab, hidden) if tied else (hidden, vocab)) / np.sqrt(hidden), jnp.bfloat16)
    params = {"final_norm": jnp.ones((hidden,), jnp.bfloat16), ("embed" if tied else "lm_head"): w}
    full = jax.jit(lambda p, r: first_argmax(compute_logits(p, r, config)))
    fused = jax.jit(lambda p, r: greedy_tokens(p, r, config))
    results = []
    for rows in rows_list:
        residual = jnp.asarray(rng.standard_normal((rows, hidden)), jnp.bfloat16)
        same = bool(np.array_equal(np.asarray(full(params, residual)), np.asarray(fused(params, residual))))
        times: dict[str, list[float]] = {"full": [], "fused": []}
        for _ in range(repeat):  # interleaved: both see the same machine load
            times["full"].append(_seconds(full, params, residual))
            times["fused"].append(_seconds(fused, params, residual))
        full_ms, fused_ms = (1e3 * float(np.median(times[k])) for k in ("full", "fused"))
        results.append(
            dict(
                rows=rows,
                chunk=vocab_chunk(rows, vocab),
                full_ms=full_ms,
                fused_ms=fused_ms,
                full_mb=logits_bytes(rows, vocab, fused=False) / 1e6,
                fused_mb=logits_bytes(rows, vocab, fused=True) / 1e6,
                same_tokens=same,
            )
        )
    return results


def format_table(results: list[dict]) -> str:
    lines = [
        f"{'rows':>5} {'chunk':>7} {'full ms':>9} {'fused ms':>9} {'fused/full':>10} "
        f"{'full f32 MB':>12} {'fused f32 MB':>13} {'same tokens':>11}"
    ]
    for r in results:
        lines.append(
            f"{r['rows']:>5} {r['chunk']:>7} {r['full_ms']:>9.3f} {r['fused_ms']:>9.3f} "
            f"{r['fused_ms'] / r['full_ms']:>10.2f} {r['full_mb']:>12.1f} {r['fused_mb']:>13.1f} "
            f"{str(r['same_tokens']):>11}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jaxllm bench lm-head", description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--tied", action="store_true", help="tied embeddings: the head is embed [V, H]")
    args = parser.parse_args(argv)
    for value, name in ((args.vocab, "--vocab"), (args.hidden, "--hidden"), (args.repeat, "--repeat")):
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    if any(r < 1 for r in args.rows):
        raise ValueError(f"--rows must be positive, got {args.rows}")
    print(f"LM head {args.hidden} x {args.vocab} bf16 ({'tied' if args.tied else 'untied'}), {jax.devices()[0]}")
    print(format_table(run(args.vocab, args.hidden, args.rows, args.repeat, args.tied)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
