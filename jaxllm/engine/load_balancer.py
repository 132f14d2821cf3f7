"""The online expert load balancer in the engine loop (TensorRT-LLM's design, plus fewer copies).

Per step, around the model forward:

- before it (`apply_round`): the layers of this step's round, {l : l % F == i} with
  F = ceil(L / k) for L MoE layers and k = `layer_updates_per_iter`, take the newest
  placement the background worker left for them (`sharding.eplb.online`); only the slots
  whose expert changes are rewritten, in place (`sharding.slot_update`: donated buffers,
  each rank receiving its own rows from the host pool `sharding.expert_pool`; a quantized
  slot weight's values, block scales and offsets are rewritten together), and the
  layer's slot table is replaced in the same parameter tree, so the next forward sees
  table and weights together. Shapes never change: nothing recompiles. Slot layers
  stored as a layer stack (the scanned layout: buffers [n, S, ...], tables [n, ...]) are
  rewritten at the layer's row of the stack, by programs that take the row as an
  argument (one compile serves every layer of the stack);
- after it (`after_forward`): the step's expert counts are folded into the decayed load
  on the device (load = 0.95 load + counts; a layer just updated starts again from its
  new counts), and once per cycle of F steps a snapshot goes to the worker, unless it
  is still busy. The step never waits for the worker or for a device read.

When a step's tokens are read back the engine hands its counts to `observe`, which
measures the imbalance each layer actually had (tokens per EP rank under the placement
that step ran with; replicas split an expert's tokens round robin, so the split is
exact) for the iteration stats, and turns them into per-slot counts for the statistics
files that `jaxllm eplb report` reads.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.models.weights import stacked_layer_rows
from sharding.eplb.eplb_config import MoeLoadBalancerConfig
from sharding.eplb.load_metrics import imbalance_ratio, rank_loads
from sharding.eplb.mapping import moved_slots
from sharding.eplb.online import PlacementWorker
from sharding.expert_load import LOAD_DECAY, decay_expert_load
from sharding.expert_pool import SLOT_WEIGHTS, ExpertWeightPool
from sharding.slot_table import SlotTable, make_slot_table
from sharding.slot_update import warm_up, write_slot_weight

# A layer is planned again only once its load holds this many steps of counts since its last
# update (a placement from one or two small steps would follow noise).
MIN_STEPS_BETWEEN_UPDATES = 8


def moe_layer_params(params: Any, layer: int) -> dict:
    """The MoE parameter dict holding decoder layer `layer`'s router, slot buffers and `slots`
    table: its own, or its layer stack's (whose arrays hold the layer at `slot_layer_row`)."""
    if params["layers"][layer]:
        return params["layers"][layer]["moe"]
    g, _ = stacked_layer_rows(params)[layer]
    return params["layer_stacks"][g]["moe"]


def slot_layer_row(params: Any, layer: int) -> Optional[int]:
    """Layer `layer`'s row in its stack's arrays, or None when it is stored apart."""
    return None if params["layers"][layer] else stacked_layer_rows(params)[layer][1]


def _set_row(table: SlotTable, row: jax.Array, new: SlotTable) -> SlotTable:
    return jax.tree.map(lambda a, n: a.at[row].set(n), table, new)


# Row `row` of a stacked slot table replaced in place (row traced: one compile per table shape).
_set_table_row = jax.jit(_set_row, donate_argnums=(0,))


def slot_counts(expert_counts: np.ndarray, slot_to_expert: np.ndarray) -> np.ndarray:
    """Exact rows per slot [..., S] of expert counts [..., E] under round-robin replica choice:
    replica j of an expert with c replicas gets the rows n with n mod c == j."""
    expert_counts = np.asarray(expert_counts, dtype=np.int64)
    table = np.asarray(slot_to_expert)
    replicas = np.bincount(table, minlength=expert_counts.shape[-1])
    order = np.argsort(table, kind="stable")  # replica j of e = its j-th slot in ascending order
    rank_in_expert = np.empty_like(order)
    starts = np.cumsum(replicas) - replicas
    rank_in_expert[order] = np.arange(table.size) - starts[table[order]]
    c = replicas[table]
    n = expert_counts[..., table]
    return n // c + (rank_in_expert < n % c)


@dataclass
class BalancerStats:
    """Running totals of the balancer (the iteration stats and the benchmark read them)."""

    rebalances: int = 0  # layer updates applied
    slots_rewritten: int = 0
    bytes_moved: int = 0  # expert rows copied host -> device (each slot's full rows)
    naive_bytes: int = 0  # what rewriting the algorithm's raw placements slot by slot would have copied
    update_seconds: list[float] = field(default_factory=list)  # host time to dispatch one layer's update


class OnlineLoadBalancer:
    """Owns the decayed load, the host pool, the placement worker and the per-step round."""

    def __init__(
        self,
        *,
        config: MoeLoadBalancerConfig,
        params: Any,
        moe_layers: list[int],
        num_experts: int,
        ep_size: int,
        mesh: jax.sharding.Mesh,
    ) -> None:
        if config.layer_updates_per_iter <= 0:
            raise ValueError("the online balancer needs layer_updates_per_iter > 0")
        missing = [l for l in moe_layers if "slots" not in moe_layer_params(params, l)]
        if not moe_layers or missing:
            raise ValueError(
                "the online expert load balancer needs the experts stored as slots: run with "
                "moe_expert_parallel_size > 1 or give load_balancer.num_slots"
            )
        self.layers = list(moe_layers)
        self.num_experts, self.ep_size = num_experts, ep_size
        self.layer_updates_per_iter = config.layer_updates_per_iter
        self.num_rounds = math.ceil(len(self.layers) / config.layer_updates_per_iter)
        # Where each layer's slots live: its row in a layer stack's arrays, or None (stored apart).
        self.rows: dict[int, Optional[int]] = {l: slot_layer_row(params, l) for l in self.layers}
        read_back: dict[int, np.ndarray] = {}  # id -> each (stacked) device array, read back once

        def on_host(array: jax.Array, row: Optional[int]) -> np.ndarray:
            copy = read_back.get(id(array))
            if copy is None:
                copy = read_back[id(array)] = np.asarray(array)
            return copy if row is None else copy[row]

        self.tables: dict[int, np.ndarray] = {
            l: on_host(moe_layer_params(params, l)["slots"].slot_to_expert, self.rows[l]) for l in self.layers
        }
        self.num_slots = int(next(iter(self.tables.values())).size)
        self.pool = ExpertWeightPool.from_slots(
            {
                l: {
                    n: jax.tree.map(lambda a, row=self.rows[l]: on_host(a, row), moe_layer_params(params, l)[n])
                    for n in SLOT_WEIGHTS
                }
                for l in self.layers
            },
            self.tables,
            num_experts,
        )
        read_back.clear()  # the host copies are in the pool now
        self._replicated = NamedSharding(mesh, P())
        self.load = jax.device_put(np.zeros((len(self.layers), num_experts), np.float32), self._replicated)
        self._no_reset = jax.device_put(np.zeros((len(self.layers),), bool), self._replicated)
        self._decay = jax.jit(lambda load, counts, reset: decay_expert_load(load, counts, LOAD_DECAY, reset))
        self._reset = np.zeros((len(self.layers),), bool)
        self._steps_since_update = np.zeros((len(self.layers),), np.int64)
        self.worker = PlacementWorker(
            num_slots=self.num_slots,
            ep_size=ep_size,
            algorithm=config.placement_algorithm,
            min_imbalance_gain=config.min_imbalance_gain,
            minimize_moves=config.minimize_moves,
        )
        self.step = 0
        self.stats = BalancerStats()
        self.last_imbalance: dict[int, float] = {}

    # ------------------------------------------------------------------ lifecycle
    def warm_up(self, params: Any) -> None:
        """Compile every update program (each row bucket of each slot-buffer shape, writing nothing)
        and the load decay, so a rebalance while serving compiles nothing."""
        seen: set = set()
        for layer in self.layers:
            moe = moe_layer_params(params, layer)
            stacked = self.rows[layer] is not None
            for name in SLOT_WEIGHTS:  # each buffer of the weight (a quantized one's scales too)
                buffers, treedef = jax.tree.flatten(moe[name])
                sources = jax.tree.leaves(self.pool.rows(layer, name))
                for i, (buffer, source) in enumerate(zip(buffers, sources)):
                    key = (buffer.shape, buffer.dtype, buffer.sharding)
                    if key not in seen:
                        seen.add(key)
                        buffers[i] = warm_up(buffer, source, stacked=stacked)
                moe[name] = jax.tree.unflatten(treedef, buffers)
            key = ("slots",) + tuple(a.shape for a in jax.tree_util.tree_leaves(moe["slots"]))
            if stacked and key not in seen:  # the table row write, rewriting row 0 with what it holds
                seen.add(key)
                moe["slots"] = self._write_table(moe["slots"], self.rows[layer], self.tables[layer])
        zero = jax.device_put(np.zeros((len(self.layers), self.num_experts), np.int32), self._replicated)
        self.load = self._decay(self.load, zero, self._no_reset)
        self.load = self._decay(self.load, zero, jax.device_put(np.ones((len(self.layers),), bool), self._replicated))

    def close(self) -> None:
        self.worker.close()

    # ------------------------------------------------------------------ the step
    def apply_round(self, params: Any) -> list[int]:
        """Rewrite the layers of this step's round that have a new placement waiting; returns their ids."""
        if self.worker.error is not None:
            raise RuntimeError("the expert placement worker failed") from self.worker.error
        updated = []
        for index in range(self.step % self.num_rounds, len(self.layers), self.num_rounds):
            layer = self.layers[index]
            update = self.worker.take(layer)
            if update is None:
                continue
            current, new = self.tables[layer], update.slot_to_expert
            changed = moved_slots(current, new)
            if not changed.size:
                continue
            start = time.perf_counter()
            moe = moe_layer_params(params, layer)
            row = self.rows[layer]
            for name in SLOT_WEIGHTS:
                moe[name] = write_slot_weight(moe[name], changed, self.pool.rows(layer, name), new[changed], layer=row)
            moe["slots"] = self._write_table(moe["slots"], row, new)
            self.stats.update_seconds.append(time.perf_counter() - start)
            self.tables = {**self.tables, layer: new}  # a new dict: steps in flight keep theirs
            row_bytes = self.pool.row_bytes(layer)
            self.stats.rebalances += 1
            self.stats.slots_rewritten += int(changed.size)
            self.stats.bytes_moved += int(changed.size) * row_bytes
            self.stats.naive_bytes += update.naive_moved * row_bytes
            self._reset[index] = True
            updated.append(layer)
        return updated

    def _write_table(self, table: SlotTable, row: Optional[int], slot_to_expert: np.ndarray) -> SlotTable:
        """The slot table with layer placement `slot_to_expert`: a new table for a layer stored
        apart, row `row` rewritten in place for a stack's table."""
        new = make_slot_table(slot_to_expert, self.num_experts, self._replicated)
        if row is None:
            return new
        return _set_table_row(table, jax.device_put(np.int32(row), self._replicated), new)

    def after_forward(self, expert_counts: jax.Array) -> None:
        """Fold the step's counts int32 [L, E] (device) into the decayed load; hand the worker a
        snapshot once per cycle of rounds (never waiting for it)."""
        reset = self._no_reset
        if self._reset.any():
            reset = jax.device_put(self._reset.copy(), self._replicated)
            self._steps_since_update[self._reset] = 0
            self._reset[:] = False
        self.load = self._decay(self.load, expert_counts, reset)
        self._steps_since_update += 1
        self.step += 1
        if self.step % self.num_rounds == 0:
            ready = [l for l, n in zip(self.layers, self._steps_since_update) if n >= MIN_STEPS_BETWEEN_UPDATES]
            if ready and self.worker.submit(self.load, self.tables, self.layers, only=ready):
                self.load.copy_to_host_async()  # the worker's read finds it on the host

    def observe(self, expert_counts: np.ndarray, tables: dict[int, np.ndarray]) -> np.ndarray:
        """A finished step's counts [L, E] under the tables it ran with: records each layer's
        measured imbalance over EP ranks and returns the per-slot counts [L, S]."""
        per_slot = np.stack([slot_counts(row, tables[l]) for row, l in zip(expert_counts, self.layers)])
        ratios = imbalance_ratio(rank_loads(per_slot, self.ep_size))
        self.last_imbalance = {l: float(r) for l, r in zip(self.layers, ratios)}
        return per_slot

    def iteration_stats(self, updated: list[int]) -> dict:
        """The `moeLoadBalancerStats` entry of an iteration's stats."""
        return {
            "layerImbalance": {str(l): round(v, 6) for l, v in self.last_imbalance.items()},
            "rebalanceCount": self.stats.rebalances,
            "updatedLayers": updated,
            "slotsRewritten": self.stats.slots_rewritten,
            "placementsComputed": self.worker.stats.placements,
        }
