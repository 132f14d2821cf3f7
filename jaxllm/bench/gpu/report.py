"""The report of `jaxllm bench gpu`: versioned schema, time shares, one `try` per section,
markdown printed line by line as it is produced.

Time budget. `run_sections` gives each section a deadline: the time left in the budget
(less a reserve for writing the report) split over the sections still to run in
proportion to their weights, so time a section leaves unused goes to the later ones.
Two mechanisms keep the command inside the budget:

* cooperative: a section runs its cases in a loop and calls `ctx.check_time()` between
  cases; past its deadline that raises `OutOfTime`, and the section ends as "timeout"
  with the rows it already produced;
* last resort: every section runs in a daemon worker thread and the main thread stops
  waiting for it at its deadline (plus a short grace), recording "timeout". A thread
  stuck in a compile cannot be killed, so `main` writes the report and ends the process
  with `os._exit` when any worker is still running.

A section with (almost) no time left when its turn comes is "skipped". Any exception a
section raises is recorded with its traceback as "failed" and the next section runs;
`SectionSkipped` (a backend missing on this platform) records "skipped" with its reason.

Test hook: `JAXLLM_BENCH_GPU_FAIL=<section key>[,<key>...]` makes those sections raise
`InjectedFailure` as they start (tests check that a failure is recorded and later
sections still run). Nothing else reads it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

from jaxllm.bench.error_summary import describe_error

SCHEMA = "jaxllm.bench.gpu/report"
SCHEMA_VERSION = 1
STATUSES = ("ok", "failed", "skipped", "timeout")
FAIL_ENV = "JAXLLM_BENCH_GPU_FAIL"
REPORT_RESERVE_S = 1.5  # kept back from the sections for writing the report
JOIN_GRACE_S = 1.0  # how long past its deadline a section's thread is waited for
MIN_SECTION_S = 0.5  # below this a section is skipped rather than started


class OutOfTime(Exception):
    """A section reached its deadline between two cases."""


class SectionSkipped(Exception):
    """The section cannot run on this platform (the reason is the message)."""


class ChecksFailed(Exception):
    """A section ran but some of its checks did not pass (listed in the message)."""


class InjectedFailure(RuntimeError):
    """Raised on purpose through `JAXLLM_BENCH_GPU_FAIL` (tests)."""


def fmt(value: Any) -> str:
    """A table cell: floats to 3 significant digits, None / NaN as '-'."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != 0 and abs(value) < 1e-2:
            return f"{value:.2e}"
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def json_safe(value: Any) -> Any:
    """NaN / inf become None so the JSON is standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class Printer:
    """Writes lines to the stream it was given (captured at start, so a section that
    redirects sys.stdout does not swallow them), flushing every line."""

    def __init__(self, stream: Optional[TextIO] = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self._lock = threading.Lock()

    def line(self, text: str = "") -> None:
        with self._lock:
            self.stream.write(text + "\n")
            self.stream.flush()


class GatedPrinter:
    """A section's view of the printer: once the section is abandoned (`close`), what its
    thread still prints is dropped instead of landing in the next section's output."""

    def __init__(self, printer: Printer) -> None:
        self.printer = printer
        self.open = True

    def line(self, text: str = "") -> None:
        if self.open:
            self.printer.line(text)

    def close(self) -> None:
        self.open = False


@dataclass
class Table:
    """A markdown table whose rows are printed as they are added and kept as JSON rows."""

    title: str
    columns: tuple[str, ...]
    rows: list[dict[str, Any]] = field(default_factory=list)
    printer: Optional[Any] = None  # Printer or GatedPrinter

    def header_lines(self) -> list[str]:
        return [
            f"#### {self.title}",
            "",
            "| " + " | ".join(self.columns) + " |",
            "|" + "|".join("---" for _ in self.columns) + "|",
        ]

    def row_line(self, row: dict[str, Any]) -> str:
        return "| " + " | ".join(fmt(row.get(c)) for c in self.columns) + " |"

    def add(self, **row: Any) -> dict[str, Any]:
        self.rows.append(row)
        if self.printer is not None:
            self.printer.line(self.row_line(row))
        return row

    def markdown(self) -> list[str]:
        return self.header_lines() + [self.row_line(r) for r in self.rows] + [""]


@dataclass
class RunOptions:
    """What every section is told: dry run (CPU, tiny shapes, interpret mode) or not, and the
    parts of the engine and speed sections asked for (empty: their defaults)."""

    dry_run: bool
    interpret: bool
    out_dir: Path
    engine_models: tuple[str, ...] = ()
    engine_backends: tuple[str, ...] = ()
    speed_parts: tuple[str, ...] = ()


class SectionContext:
    """What a section writes into: numbers (`data`), tables, notes; and its deadline."""

    def __init__(
        self, key: str, options: RunOptions, deadline: float, shared: dict[str, Any], printer: Printer
    ) -> None:
        self.key = key
        self.options = options
        self.deadline = deadline
        self.shared = shared  # results later sections read (the environment's ceilings)
        self.printer = GatedPrinter(printer)
        self.data: dict[str, Any] = {}
        self.tables: list[Table] = []
        self.notes: list[str] = []

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def check_time(self, what: str = "") -> None:
        if self.time_left() <= 0:
            raise OutOfTime(f"section time share used up{' before ' + what if what else ''}")

    @contextlib.contextmanager
    def share(self, fraction: float) -> Iterator[None]:
        """Within the block the deadline is `fraction` of the time left (later parts keep the rest)."""
        saved = self.deadline
        self.deadline = min(saved, time.monotonic() + fraction * max(0.0, self.time_left()))
        try:
            yield
        finally:
            self.deadline = saved

    def run_case(self, name: str, fn: Callable[[], Any]) -> bool:
        """Runs one case; an exception (other than running out of time) is noted with its
        traceback in `data["case_errors"]` and the section goes on with the next case."""
        try:
            fn()
            return True
        except (OutOfTime, SectionSkipped):
            raise
        except Exception as e:  # noqa: BLE001 - one case's failure (e.g. out of memory) is not the section's
            self.data.setdefault("case_errors", []).append(
                {"case": name, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            )
            self.note(f"{name}: {describe_error(e)}")
            return False

    def table(self, title: str, columns: Sequence[str]) -> Table:
        table = Table(title, tuple(columns), printer=self.printer)
        self.tables.append(table)
        for line in table.header_lines():
            self.printer.line(line)
        return table

    def note(self, text: str) -> None:
        self.notes.append(text)
        self.printer.line(f"- {text}")


@dataclass(frozen=True)
class Section:
    key: str
    title: str
    weight: float  # share of the budget, relative to the other sections
    dry_weight: float  # the same in a dry run (interpret-mode compiles dominate there)
    run: Callable[[SectionContext], None]

    def share_weight(self, dry_run: bool) -> float:
        return self.dry_weight if dry_run else self.weight


@dataclass
class SectionResult:
    key: str
    title: str
    status: str = "skipped"
    reason: str = ""
    error: Optional[str] = None
    traceback: Optional[str] = None
    seconds: float = 0.0
    time_share_s: float = 0.0
    data: dict[str, Any] = field(default_factory=dict)
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return json_safe(
            {
                "key": self.key,
                "title": self.title,
                "status": self.status,
                "reason": self.reason,
                "error": self.error,
                "traceback": self.traceback,
                "seconds": round(self.seconds, 3),
                "time_share_s": round(self.time_share_s, 3),
                "data": self.data,
                "tables": [{"title": t.title, "columns": list(t.columns), "rows": t.rows} for t in self.tables],
                "notes": self.notes,
            }
        )


def _injected(key: str) -> bool:
    return key in {k.strip() for k in os.environ.get(FAIL_ENV, "").split(",") if k.strip()}


def _run_body(section: Section, ctx: SectionContext, outcome: dict[str, Any]) -> None:
    """The worker thread: one `try` around the whole section; the outcome is read by the
    main thread only if it is still waiting (an abandoned section's late outcome is ignored)."""
    try:
        if _injected(section.key):
            raise InjectedFailure(f"{FAIL_ENV} asked section {section.key!r} to fail")
        section.run(ctx)
        outcome.update(status="ok")
    except OutOfTime as e:
        outcome.update(status="timeout", reason=str(e))
    except SectionSkipped as e:
        outcome.update(status="skipped", reason=str(e))
    except BaseException as e:  # noqa: BLE001 - recorded, and the next section runs
        outcome.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())


def run_sections(
    sections: Sequence[Section], options: RunOptions, budget_s: float, started: float, printer: Printer
) -> tuple[list[SectionResult], bool]:
    """Runs the sections in order under their time shares: (results, whether a worker is
    still running past its deadline)."""
    end = started + budget_s - REPORT_RESERVE_S
    shared: dict[str, Any] = {}
    results: list[SectionResult] = []
    stuck = False
    for i, section in enumerate(sections):
        now = time.monotonic()
        weights = sum(s.share_weight(options.dry_run) for s in sections[i:])
        weight = section.share_weight(options.dry_run)
        share = max(0.0, (end - now) * weight / weights) if weights > 0 else 0.0
        result = SectionResult(section.key, section.title, time_share_s=share)
        results.append(result)
        printer.line(f"## {i + 1}. {section.title}")
        printer.line("")
        if share < MIN_SECTION_S:
            result.status, result.reason = "skipped", "no time left in the budget"
            printer.line(f"status: skipped ({result.reason})")
            printer.line("")
            continue
        ctx = SectionContext(section.key, options, now + share, shared, printer)
        outcome: dict[str, Any] = {}
        worker = threading.Thread(
            target=_run_body, args=(section, ctx, outcome), daemon=True, name=f"jaxllm-bench-gpu-{section.key}"
        )
        worker.start()
        worker.join(timeout=max(0.0, min(now + share + JOIN_GRACE_S, end) - time.monotonic()))
        result.seconds = time.monotonic() - now
        if worker.is_alive():  # abandoned: keep a snapshot of what it produced so far
            ctx.printer.close()
            stuck = True
            result.status = "timeout"
            result.reason = f"still running {share:.0f} s into its share; abandoned"
            result.data = dict(ctx.data)
            result.tables = [Table(t.title, t.columns, list(t.rows)) for t in list(ctx.tables)]
        else:
            result.status = outcome.get("status", "failed")
            result.reason = outcome.get("reason", "")
            result.error, result.traceback = outcome.get("error"), outcome.get("traceback")
            result.data, result.tables = ctx.data, list(ctx.tables)
        result.notes = list(ctx.notes)
        printer.line("")
        line = f"status: {result.status}"
        if result.reason:
            line += f" ({result.reason})"
        if result.error:
            line += f": {result.error}"
        printer.line(line)
        printer.line("")
    return results, stuck


def report_json(meta: dict[str, Any], results: Sequence[SectionResult]) -> dict[str, Any]:
    return json_safe(
        {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, **meta, "sections": {r.key: r.to_json() for r in results}}
    )


def report_markdown(meta: dict[str, Any], results: Sequence[SectionResult]) -> str:
    lines = [
        f"# jaxllm GPU report{' (DRY RUN: CPU, tiny shapes, timings meaningless)' if meta['dry_run'] else ''}",
        "",
        f"- created: {meta['created']}",
        f"- budget: {meta['budget_s']} s, took {meta['seconds']:.1f} s",
        f"- command: `{meta['command']}`",
        "",
        "| section | status | seconds | note |",
        "|---|---|---|---|",
    ]
    for r in results:
        note = r.reason or (r.error or "")
        lines.append(f"| {r.title} | {r.status} | {r.seconds:.1f} | {note.splitlines()[0][:120] if note else ''} |")
    lines.append("")
    for i, r in enumerate(results):
        lines += [f"## {i + 1}. {r.title}", "", f"status: **{r.status}**" + (f" ({r.reason})" if r.reason else ""), ""]
        lines += [f"- {n}" for n in r.notes]
        if r.notes:
            lines.append("")
        for table in r.tables:
            lines += table.markdown()
        if r.traceback:
            lines += ["```", r.traceback.rstrip(), "```", ""]
    return "\n".join(lines) + "\n"


def write_report(out_dir: Path, meta: dict[str, Any], results: Sequence[SectionResult]) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "gpu_report.json", out_dir / "gpu_report.md"
    json_path.write_text(json.dumps(report_json(meta, results), indent=1, default=str) + "\n", encoding="utf-8")
    md_path.write_text(report_markdown(meta, results), encoding="utf-8")
    return json_path, md_path
