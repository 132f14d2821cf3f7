"""A step whose host inputs cannot be built: find the requests that cause it and plan the rest.

Requests are checked at admission, so this is a backstop: when `planner.build` raises, each
request is built alone, those that fail alone are left out (all of them when none does) and
the others are planned; the engine fails only the left-out requests and goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from jaxllm.engine.step_plan import StepPlan, TokenEntry
from jaxllm.llm_request import LlmRequest
from jaxllm.scheduler import SchedulerOutput


@dataclass
class BuiltStep:
    """`build_step`'s result: the plan (None when nothing could be planned), the scheduler
    output it plans, and the requests left out with the exception each group raised."""

    plan: Optional[StepPlan]
    output: SchedulerOutput
    failures: list[tuple[list[LlmRequest], Exception]] = field(default_factory=list)


def build_isolating_failures(planner: Any, output: SchedulerOutput, in_flight: Optional[list[TokenEntry]]) -> BuiltStep:
    """`planner.build(output, in_flight)`; when it raises, the requests whose plan cannot be
    built even alone are left out (all of them when none fails alone) and the others planned."""
    try:
        return BuiltStep(planner.build(output, in_flight), output)
    except Exception as exc:
        culprits = _culprits(planner, output, in_flight) or output.all_requests()
        failures = [(culprits, exc)]
    failed = set(culprits)
    output = SchedulerOutput(
        [r for r in output.context_requests if r not in failed],
        [r for r in output.generation_requests if r not in failed],
        output.paused_requests,
        output.num_fitting_requests,
    )
    if output.is_empty:
        return BuiltStep(None, output, failures)
    try:
        return BuiltStep(planner.build(output, in_flight), output, failures)
    except Exception as exc:
        return BuiltStep(None, output, failures + [(output.all_requests(), exc)])


def _culprits(planner: Any, output: SchedulerOutput, in_flight: Optional[list[TokenEntry]]) -> list[LlmRequest]:
    """The requests of a step whose plan cannot be built even alone."""
    alone = [SchedulerOutput([r], []) for r in output.context_requests]
    alone += [SchedulerOutput([], [r]) for r in output.generation_requests]
    culprits = []
    for single in alone:
        try:
            planner.build(single, in_flight)
        except Exception:
            culprits += single.all_requests()
    return culprits
