"""`jaxllm bench gpu`: the one-command GPU acceptance run.

    PYTHONPATH=. python -m jaxllm.bench.gpu --out /tmp/gpu       # on a GPU machine, from a checkout
    jaxllm bench gpu --dry-run --out /tmp/gpu-dry                 # CPU: tiny shapes, interpret mode
    python -m jaxllm.bench.gpu --out /tmp/g --sections engine --engine-models llama-3-8b  # one model

Sections (each under its own time share and its own `try`; see `report` for the budget):
  env       device, software, backends `auto` picks, measured copy bandwidth and bf16 matmul
  kernels   kernel correctness against the references at real shapes (bf16, NaN-poisoned pages)
  speed     decode attention GB/s and MoE grouped FFN TFLOP/s against the roofline and cost model
  engine    engine end to end on full-size random-weight models, Pallas and XLA backends, with MBU
  numerics  greedy tokens of a seeded tiny float32 model against tokens recorded on CPU
Writes OUT/gpu_report.json and OUT/gpu_report.md and prints the markdown as it goes.
Imports nothing of the server (no fastapi, uvicorn or pydantic).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

IMPORTED_AT = time.monotonic()  # the budget counts from here when `main` runs right after the import

import jax  # noqa: E402 - after IMPORTED_AT: importing jax is part of the command's time

from jaxllm.bench.gpu import (  # noqa: E402
    engine_plan,
    engine_run,
    environment,
    kernel_checks,
    kernel_speed,
    numerics,
)
from jaxllm.bench.gpu.report import (  # noqa: E402
    Printer,
    RunOptions,
    Section,
    report_markdown,
    run_sections,
    write_report,
)

SECTIONS = (
    Section("env", "Environment", 1.0, 0.5, environment.run),
    Section("kernels", "Kernel correctness on the device", 3.0, 3.0, kernel_checks.run),
    Section("speed", "Kernel speed", 3.0, 2.0, kernel_speed.run),
    Section("engine", "Engine end to end", 5.0, 3.0, engine_run.run),
    Section("numerics", "Numerics against CPU", 1.5, 2.5, numerics.run),
)
DEFAULT_BUDGET_S = 420.0
DRY_RUN_BUDGET_S = 120.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxllm bench gpu",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("--out", required=True, help="directory for gpu_report.json and gpu_report.md")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"the whole command ends within this many seconds (default {DEFAULT_BUDGET_S:.0f}; "
        f"{DRY_RUN_BUDGET_S:.0f} with --dry-run)",
    )
    parser.add_argument(
        "--sections",
        default=",".join(s.key for s in SECTIONS),
        help="comma-separated sections to run (they run in this order whatever the order given): "
        + ", ".join(s.key for s in SECTIONS),
    )
    parser.add_argument(
        "--engine-models",
        default="",
        help="engine section: comma-separated models (default: "
        + ",".join(engine_plan.DEFAULT_MODELS)
        + "; known: "
        + ", ".join(engine_plan.MODELS)
        + "); one per command keeps each command short",
    )
    parser.add_argument(
        "--engine-backends",
        default="",
        help="engine section: comma-separated backends (default: " + ",".join(engine_plan.BACKENDS) + ")",
    )
    parser.add_argument(
        "--speed-parts",
        default="",
        help="speed section: comma-separated parts (default: all of " + ", ".join(kernel_speed.SPEED_PARTS) + ")",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU: every section at tiny shapes, kernels in interpret mode (timings meaningless)",
    )
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    now = time.monotonic()
    started = IMPORTED_AT if now - IMPORTED_AT < 30 else now  # imports (jax) count when they just happened
    args = build_parser().parse_args(argv)
    if args.budget_s is None:
        args.budget_s = DRY_RUN_BUDGET_S if args.dry_run else DEFAULT_BUDGET_S
    keys = [k.strip() for k in args.sections.split(",") if k.strip()]
    unknown = [k for k in keys if k not in {s.key for s in SECTIONS}]
    if unknown:
        print(
            f"jaxllm bench gpu: unknown section(s) {', '.join(unknown)}; known: {', '.join(s.key for s in SECTIONS)}",
            file=sys.stderr,
        )
        return 2
    selections = {
        "--engine-models": (args.engine_models, tuple(engine_plan.MODELS)),
        "--engine-backends": (args.engine_backends, engine_plan.BACKENDS),
        "--speed-parts": (args.speed_parts, kernel_speed.SPEED_PARTS),
    }
    chosen: dict[str, tuple[str, ...]] = {}
    for flag, (value, known) in selections.items():
        chosen[flag] = tuple(k.strip() for k in value.split(",") if k.strip())
        wrong = [k for k in chosen[flag] if k not in known]
        if wrong:
            print(f"jaxllm bench gpu: unknown {flag} {', '.join(wrong)}; known: {', '.join(known)}", file=sys.stderr)
            return 2
    if not args.dry_run and jax.default_backend() != "gpu":
        print(
            f"jaxllm bench gpu: no GPU (jax backend {jax.default_backend()!r}); run on a CUDA machine or pass "
            "--dry-run for the CPU rehearsal",
            file=sys.stderr,
        )
        return 2
    from pallas_kernels.triton_backend import filter_triton_deprecation

    filter_triton_deprecation()
    sections = [s for s in SECTIONS if s.key in keys]
    out_dir = Path(args.out)
    options = RunOptions(
        dry_run=args.dry_run,
        interpret=args.dry_run or jax.default_backend() != "gpu",
        out_dir=out_dir,
        engine_models=chosen["--engine-models"],
        engine_backends=chosen["--engine-backends"],
        speed_parts=chosen["--speed-parts"],
    )
    printer = Printer()
    printer.line(f"# jaxllm GPU report{' (DRY RUN)' if args.dry_run else ''}")
    printer.line("")
    results, stuck = run_sections(sections, options, args.budget_s, started, printer)
    meta = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "dry_run": args.dry_run,
        "budget_s": args.budget_s,
        "seconds": time.monotonic() - started,
        "command": "jaxllm bench gpu " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        "sections_requested": keys,
    }
    json_path, md_path = write_report(out_dir, meta, results)
    printer.line(f"wrote {json_path} and {md_path}")
    code = 0 if all(r.status in ("ok", "skipped") for r in results) else 1
    if stuck:  # a worker thread is stuck (e.g. in a compile): it cannot be joined, so leave now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


__all__ = ["SECTIONS", "build_parser", "main", "report_markdown"]
