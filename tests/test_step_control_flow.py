"""No step program loops or branches on a device value: XLA's optimized HLO of every program
the engine compiles holds no `while` without a known trip count and no `conditional`.

On a GPU either one is a host round trip per iteration (the runtime copies the predicate
back and waits), so a step whose layers hold one is bound by the host, and no overlap
scheduler hides it. The engines here (dense, MoE, DeepSeek-V3's MLA with its MTP layers,
n-gram, draft-model and EAGLE-3 speculation, FP8 and int4 weights, and beam search,
penalties, guided decoding, logits outputs and the host KV tier) are built in a fresh
interpreter with XLA dumping every module it compiles, the compilation cache off (a hit
would not be dumped); see `tests/step_programs.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.step_programs import CASES, scan_hlo  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dumped(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("hlo_dump")
    env = dict(os.environ)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env["JAXLLM_COMPILE_CACHE"] = "0"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={directory} --xla_dump_hlo_as_text".strip()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "step_programs.py"), *CASES],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for case in CASES:
        assert f"served {case}" in proc.stdout
    return directory


def test_every_program_kind_was_compiled_and_dumped(dumped):
    """The scan below covers what the engine runs: forwards, samplers, each drafter's program,
    the verification, the KV block copy and the logits row programs were all compiled here."""
    names = [p.name for p in dumped.glob("*after_optimizations.txt")]
    counts = {kind: sum(f".{kind}." in n for n in names) for kind in ("jit_model_forward_step", "jit__sample_step")}
    assert counts["jit_model_forward_step"] >= 10 and counts["jit__sample_step"] >= 10, counts
    assert sum(".jit__draft_program." in n for n in names) >= 3  # draft model, EAGLE-3, MTP
    for kind in ("jit_verify_drafts", "jit__copy_pages", "jit__gather_rows"):
        assert any(f".{kind}." in n for n in names), kind


def test_no_while_without_a_known_trip_count_and_no_conditional(dumped):
    flow = scan_hlo(dumped)
    assert flow.modules >= 80
    assert flow.num_unbounded == 0 and flow.num_conditionals == 0, flow.describe()


def test_the_scan_sees_a_device_valued_loop_and_a_branch(tmp_path):
    """The counting itself: a loop whose trip count is an argument and a `lax.cond` are found, a
    `fori_loop` over Python ints is not (its trip count is known)."""
    script = (
        "import jax, jax.numpy as jnp\n"
        "f = lambda n, x: jax.lax.fori_loop(0, n, lambda i, y: y * 1.5 + i, x)\n"
        "g = lambda x: jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x)\n"
        "h = lambda x: jax.lax.fori_loop(0, 7, lambda i, y: y * 1.5 + i, x)\n"
        "x = jnp.ones(4)\n"
        "jax.jit(f)(3, x); jax.jit(g)(x); jax.jit(h)(x)\n"
    )
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text", JAXLLM_COMPILE_CACHE="0")
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=300)
    flow = scan_hlo(tmp_path)
    assert flow.num_unbounded == 1 and list(flow.unbounded)[0].endswith("jit__lambda")
    assert flow.num_conditionals == 1
    assert flow.modules >= 3
