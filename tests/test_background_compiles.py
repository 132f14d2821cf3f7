"""Background compiles on a CPU wait while engines are busy (`jaxllm.engine.background_compiles`),
but an engine that is never idle still gets the compiles its steps paid for: one that waited
`max_hold_seconds` starts while busy, one at a time; idle work still waits for quiet."""

from __future__ import annotations

import threading

from jaxllm.engine.background_compiles import BackgroundCompiles, EngineActivity


class _Engine:
    """Stands for an engine in `EngineActivity` (held by weak reference)."""


def test_a_paid_compile_starts_while_busy_after_its_hold_and_idle_work_waits_for_quiet():
    activity = EngineActivity()
    engine = _Engine()
    activity.set_busy(engine, True)
    compiles = BackgroundCompiles(1, hold_while_busy=True, settle_seconds=0.05, max_hold_seconds=0.2, activity=activity)
    ran: list[str] = []
    try:
        idle = compiles.submit(ran.append, "idle", idle=True)
        paid = compiles.submit(ran.append, "paid")
        paid.result(timeout=30)
        assert ran == ["paid"] and compiles.started_busy == 1
        assert not idle.done()  # still busy: idle work waits
        activity.set_busy(engine, False)
        idle.result(timeout=30)
        assert ran == ["paid", "idle"] and compiles.started_busy == 1
    finally:
        compiles.close()


def test_without_a_hold_limit_paid_compiles_wait_for_quiet_too():
    activity = EngineActivity()
    engine = _Engine()
    activity.set_busy(engine, True)
    compiles = BackgroundCompiles(
        1, hold_while_busy=True, settle_seconds=0.05, max_hold_seconds=None, activity=activity
    )
    started = threading.Event()
    try:
        paid = compiles.submit(started.set)
        assert not started.wait(0.5) and not paid.done()
        activity.set_busy(engine, False)
        paid.result(timeout=30)
        assert compiles.started_busy == 0
    finally:
        compiles.close()
