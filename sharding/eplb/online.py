"""The host half of the online expert load balancer: placements recomputed in a background thread.

The step loop hands the worker a snapshot of the decayed per-layer expert loads (a device
array; the worker reads it back itself, so the step never waits for the copy) together
with the placement each layer has now. For every layer the worker

1. computes a placement from the loads with one of the offline algorithms (`greedy` by
   default: ~3 ms per layer at DeepSeek-V3 scale, 256 experts over 288 slots and 32 ranks;
   `balanced` is ~0.75 s per layer there, too slow to follow the traffic);
2. predicts the imbalance ratio of the current and of the new placement under those loads
   and drops the new one when the gain is below `min_imbalance_gain` (a rebalance that
   would hardly help is not worth its copies; a negative threshold applies any placement
   that differs, which tests use to move many slots);
3. with `minimize_moves`, rewrites as few slots as it can (`sharding.eplb.mapping`): it
   first lays the new placement onto the current one (whole ranks and slots relabelled:
   `map_onto`), then tries to reach the same predicted imbalance (within
   INCREMENTAL_TOLERANCE) by local-search moves from the current table
   (`incremental_placement`) and keeps whichever rewrites fewer slots;

and leaves the result for the step loop to pick up, layer by layer, when each layer's
update round comes (`take`). `submit` never blocks: while the worker is busy a new
snapshot is refused and the step goes on.

Only numpy and threading here; which device arrays change is the engine's business.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from sharding.eplb.load_metrics import imbalance_ratio, rank_loads, slot_loads
from sharding.eplb.mapping import incremental_placement, map_onto, moved_slots
from sharding.eplb.placement import ALGORITHMS, compute_placement

# An incremental placement may be this much more imbalanced (predicted ratio) than the fresh one.
INCREMENTAL_TOLERANCE = 0.01


def predicted_imbalance(load: np.ndarray, slot_to_expert: np.ndarray, ep_size: int) -> float:
    """Imbalance ratio over EP ranks of expert loads [E] under a placement (tokens split evenly over replicas)."""
    return float(imbalance_ratio(rank_loads(slot_loads(load, slot_to_expert), ep_size)))


@dataclass(frozen=True)
class PlacementUpdate:
    """A new slot table for one MoE layer, laid onto the table it was computed against."""

    layer: int
    slot_to_expert: np.ndarray
    based_on: np.ndarray  # the table it replaces (the step loop rewrites the slots that differ)
    imbalance_before: float  # predicted from the loads the worker saw
    imbalance_after: float
    naive_moved: int  # slots a rewrite of the algorithm's raw placement would have copied


@dataclass
class WorkerStats:
    """What the worker has done so far (read by the engine's iteration stats and the benchmark)."""

    rounds: int = 0  # snapshots processed
    placements: int = 0  # layer placements computed
    proposed: int = 0  # updates left for the step loop
    skipped_small_gain: int = 0
    skipped_unchanged: int = 0
    incremental: int = 0  # updates reached by moving from the current table rather than relabelling
    seconds: list[float] = field(default_factory=list)  # host time per snapshot (all layers)


class PlacementWorker:
    """Background placement thread: `submit` loads, `take` per-layer updates; `close` ends it."""

    def __init__(
        self,
        *,
        num_slots: int,
        ep_size: int,
        algorithm: str = "greedy",
        min_imbalance_gain: float = 0.0,
        minimize_moves: bool = True,
        name: str = "jaxllm-eplb",
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown placement algorithm {algorithm!r}; choose one of {list(ALGORITHMS)}")
        self.num_slots, self.ep_size = num_slots, ep_size
        self.algorithm = algorithm
        self.min_imbalance_gain = float(min_imbalance_gain)
        self.minimize_moves = minimize_moves
        self.stats = WorkerStats()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._job: Optional[tuple[Any, dict[int, np.ndarray], list[Optional[int]]]] = None
        self._busy = False
        self._closed = False
        self._pending: dict[int, PlacementUpdate] = {}
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ step-loop side (never blocks long)
    def submit(
        self, loads: Any, tables: Mapping[int, np.ndarray], layers: Sequence[int], only: Optional[Sequence[int]] = None
    ) -> bool:
        """Queue loads [num_layers, E] (row i: `layers[i]`; numpy or a device array the worker reads
        back) with the current tables; `only`: the layers to plan (default all). False, and nothing
        queued, while the worker is busy."""
        with self._lock:
            if self._busy or self._closed:
                return False
            chosen = set(layers if only is None else only)
            self._job = (loads, dict(tables), [l if l in chosen else None for l in layers])
            self._busy = True
            self._wake.notify()
            return True

    def take(self, layer: int) -> Optional[PlacementUpdate]:
        """The newest update of `layer` not yet taken, or None."""
        with self._lock:
            return self._pending.pop(layer, None)

    def offer(self, update: PlacementUpdate) -> None:
        """Queue an update computed elsewhere (an offline placement, say) for its layer, as if
        the worker had planned it; the next `take` of that layer returns it."""
        with self._lock:
            self._pending[update.layer] = update

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._busy

    @property
    def alive(self) -> bool:
        """Whether the worker thread still runs (it ends at `close`)."""
        return self._thread.is_alive()

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until the worker has finished its job (tests and benchmarks only)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.busy:
                return True
            time.sleep(0.001)
        return False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ worker side
    def _run(self) -> None:
        while True:
            with self._lock:
                while self._job is None and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                if self._job is None:
                    raise AssertionError("the worker only wakes for a job or for close()")
                loads, tables, layers = self._job
                self._job = None
            try:
                start = time.perf_counter()
                updates = self.plan(np.asarray(loads, dtype=np.float64), tables, layers)
                elapsed = time.perf_counter() - start
                with self._lock:
                    for update in updates:
                        self._pending[update.layer] = update
                    self.stats.seconds.append(elapsed)
                    self.stats.rounds += 1
            except BaseException as exc:  # keep serving with the current placement; report it
                self.error = exc
            finally:
                with self._lock:
                    self._busy = False

    def plan(
        self, loads: np.ndarray, tables: Mapping[int, np.ndarray], layers: Sequence[Optional[int]]
    ) -> list[PlacementUpdate]:
        """The updates worth applying for loads [len(layers), E] (rows whose layer is None are skipped;
        runs on the worker thread, also callable directly)."""
        updates = []
        for row, layer in zip(loads, layers):
            if layer is None:
                continue
            current = tables.get(layer)
            if current is None or row.sum() <= 0:
                continue
            raw = compute_placement(row, self.num_slots, self.ep_size, self.algorithm)
            self.stats.placements += 1
            before = predicted_imbalance(row, current, self.ep_size)
            after = predicted_imbalance(row, raw, self.ep_size)
            if before - after < self.min_imbalance_gain:
                self.stats.skipped_small_gain += 1
                continue
            new = raw
            if self.minimize_moves:
                new = map_onto(current, raw, self.ep_size)
                closer = incremental_placement(
                    row,
                    current,
                    self.ep_size,
                    after + INCREMENTAL_TOLERANCE,
                    max_moved=int(moved_slots(current, new).size),
                )
                if closer is not None:
                    new = closer
                    self.stats.incremental += 1
            if np.array_equal(new, current):
                self.stats.skipped_unchanged += 1
                continue
            self.stats.proposed += 1
            updates.append(
                PlacementUpdate(
                    layer,
                    np.asarray(new, np.int32),
                    np.asarray(current, np.int32),
                    before,
                    after,
                    int(moved_slots(current, raw).size),
                )
            )
        return updates
