"""The expert-parallel MoE layer: route, map experts to slots, dispatch, grouped FFN, combine.

Layout (mesh axes `expert` x `tensor`, E x T devices): the slot weights [S, H, I] are
split over `expert` by slot (rank r owns slots [r S/E, (r+1) S/E)) and over `tensor`
by the expert FFN's intermediate columns. Routing runs on every device over the whole
step (it is a small matmul), which makes the expert counts global and the replica
choice (`sharding.slot_table.choose_slots`) identical everywhere; then, under
`shard_map`, each EP rank takes its share of the step's tokens (1/E of them) and:

- `all_to_all`: sends each (token, k) row to the rank owning its slot, in a send buffer
  of `capacity` rows per destination; the owner runs the grouped FFN on what it
  received and sends the results back through a second all_to_all into the same
  positions; the source combines them with the routing weights. The capacity comes from
  the step's token bucket: dropless by default (every row of a rank could go to one
  destination: tokens x min(top_k, slots per rank)); a `capacity_factor` opts into a
  smaller buffer, cap = ceil(factor * tokens * top_k / E), and rows beyond it are
  dropped and counted.
- `allgather`: gathers every rank's tokens, runs the grouped FFN for the rows that fall
  on the rank's own slots, combines, and returns each rank its tokens' sums with a
  reduce-scatter (psum_scatter). No capacity and no per-destination layout: for small
  decode batches, where the all_to_all buffers are mostly padding.

MoE tensor parallelism: the T ranks of an expert group hold the same tokens and the
same slots with a 1/T share of the FFN columns; their partial outputs are summed with
a psum over `tensor` after the combine. The output leaves the shard_map split over
`expert` by token; XLA gathers it where the replicated residual stream needs it.

- `ragged_all_to_all`: the rows sorted by destination go out as one ragged exchange whose
  sizes and offsets stay on the device (seed 001: no host sync on communication sizes):
  one all_gather of the E x E row counts gives every rank its receive sizes and where
  its rows land in each receiver's buffer; nothing is padded on the wire and the grouped
  FFN skips the unused tail of the (dropless, E x rows) receive buffer. XLA:CPU does not
  implement the collective (the engine refuses this mode on CPU) and it is reported slow
  on GPU (openxla/xla #46982), so it is an option, never the default.
  `EpMoeOptions(ragged_emulation=True)` runs the same code with the collective emulated by
  a dense all_to_all (`sharding.ep_dispatch.emulated_ragged_all_to_all`), which is how CPU tests check it; the
  CUDA lowering of the real collective is checked from CPU with `lowering_platforms`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxllm.models.model_config import ModelConfig
from jaxllm.models.moe import (
    MoeFn,
    combine,
    expert_operands,
    expert_rows_ffn,
    fp8_expert_operands,
    fp8_expert_rows_ffn,
    fp8_experts_fn,
    route_layer,
)
from sharding.ep_dispatch import a2a_capacity, emulated_ragged_all_to_all
from sharding.expert_load import count_experts
from sharding.mesh import EXPERT_AXIS, TENSOR_AXIS
from sharding.rules import ShardingRules, logical_to_physical
from sharding.slot_table import SlotTable, choose_slots

# `rows_ffn(x, ids, *experts, rows_per_token=1)`: the grouped FFN of the rows (`expert_rows_ffn`).
RowsFfn = Callable[..., jax.Array]

DISPATCH_MODES = ("auto", "all_to_all", "allgather", "ragged_all_to_all")


@dataclass(frozen=True)
class EpMoeOptions:
    """Static choices of the expert-parallel MoE layer (part of the compiled step)."""

    dispatch: str = "auto"  # "all_to_all", "allgather", or "auto": by the step's token bucket
    capacity_factor: float | None = None  # None: dropless all_to_all
    # "auto" uses allgather for buckets of at most this many tokens, all_to_all above. Measured on
    # 8 XLA:CPU devices (EP 8, 64 experts, top-8; `jaxllm bench ep`), allgather was as fast or
    # faster than the dropless all_to_all at every bucket from 16 to 4096 tokens (the dropless
    # send buffers are as large as the whole step's rows); all_to_all moves E times less data
    # per token, which should pay off on real interconnects with large steps.
    allgather_max_tokens: int = 4096
    # ragged_all_to_all only: run its semantics with a dense all_to_all (platforms without the
    # collective, e.g. XLA:CPU; for checking the dispatch logic, not for speed).
    ragged_emulation: bool = False

    def __post_init__(self) -> None:
        if self.dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch must be one of {DISPATCH_MODES}, got {self.dispatch!r}")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"capacity_factor must be positive (or None: dropless), got {self.capacity_factor!r}")

    def mode_for(self, num_tokens: int) -> str:
        if self.dispatch != "auto":
            return self.dispatch
        return "allgather" if num_tokens <= self.allgather_max_tokens else "all_to_all"


def _all_to_all_body(x, slots, weights, *experts, rows_ffn: RowsFfn, capacity_factor, ep: int, moe_tp: int):
    tokens, top_k = slots.shape
    slots_per_rank = experts[0].shape[0]
    cap = a2a_capacity(tokens, top_k, slots_per_rank, ep, capacity_factor)
    rows = tokens * top_k
    flat = slots.reshape(-1)
    dest = flat // slots_per_rank  # == ep for padding rows (slot id S)
    # Position of each row among the rows going to the same destination (row order).
    order = jnp.argsort(dest, stable=True)
    sizes = jnp.bincount(dest, length=ep + 1)
    starts = (jnp.cumsum(sizes) - sizes).astype(jnp.int32)
    pos_sorted = jnp.arange(rows, dtype=jnp.int32) - starts[dest[order]]
    pos = jnp.zeros((rows,), jnp.int32).at[order].set(pos_sorted, unique_indices=True)
    routed = dest < ep
    kept = routed & (pos < cap)
    dropped = jnp.sum(routed & ~kept).astype(jnp.int32)
    target = jnp.where(kept, dest * cap + pos, ep * cap)  # out of range: not sent
    send_x = jnp.zeros((ep * cap, x.shape[1]), x.dtype).at[target].set(x[jnp.arange(rows) // top_k], mode="drop")
    send_ids = jnp.full((ep * cap,), slots_per_rank, jnp.int32).at[target].set(flat % slots_per_rank, mode="drop")
    recv_x = jax.lax.all_to_all(send_x, EXPERT_AXIS, 0, 0, tiled=True)
    recv_ids = jax.lax.all_to_all(send_ids, EXPERT_AXIS, 0, 0, tiled=True)
    y = rows_ffn(recv_x, recv_ids, *experts)
    back = jax.lax.all_to_all(y, EXPERT_AXIS, 0, 0, tiled=True)
    y_rows = jnp.where(kept[:, None], back[jnp.minimum(target, ep * cap - 1)], 0)
    out = combine(y_rows, jnp.where(kept.reshape(tokens, top_k), weights, 0.0))
    if moe_tp > 1:
        out = jax.lax.psum(out, TENSOR_AXIS)
    return out, jax.lax.psum(dropped, EXPERT_AXIS)[None]


def _ragged_all_to_all_body(x, slots, weights, *experts, rows_ffn: RowsFfn, ep: int, moe_tp: int, emulate: bool):
    exchange = functools.partial(
        emulated_ragged_all_to_all if emulate else jax.lax.ragged_all_to_all, axis_name=EXPERT_AXIS
    )
    tokens, top_k = slots.shape
    slots_per_rank = experts[0].shape[0]
    rows = tokens * top_k
    flat = slots.reshape(-1)
    dest = flat // slots_per_rank  # == ep for padding rows (slot id S): sorted last, never sent
    order = jnp.argsort(dest, stable=True)
    sizes = jnp.bincount(dest, length=ep + 1)[:ep].astype(jnp.int32)  # rows to each rank
    send_offsets = (jnp.cumsum(sizes) - sizes).astype(jnp.int32)
    matrix = jax.lax.all_gather(sizes, EXPERT_AXIS)  # [sender, receiver] row counts
    me = jax.lax.axis_index(EXPERT_AXIS)
    earlier = jnp.arange(ep)[:, None] < me
    land_at = jnp.sum(jnp.where(earlier, matrix, 0), axis=0).astype(jnp.int32)  # my rows' offset at each receiver
    recv_sizes = matrix[:, me]
    recv_offsets = (jnp.cumsum(recv_sizes) - recv_sizes).astype(jnp.int32)
    buffer_rows = ep * rows  # dropless: every rank may send all its rows here
    recv_x = exchange(
        x[order // top_k], jnp.zeros((buffer_rows, x.shape[1]), x.dtype), send_offsets, sizes, land_at, recv_sizes
    )
    recv_ids = exchange(
        (flat % slots_per_rank)[order],
        jnp.full((buffer_rows,), slots_per_rank, jnp.int32),
        send_offsets,
        sizes,
        land_at,
        recv_sizes,
    )
    y = rows_ffn(recv_x, recv_ids, *experts)
    # Back to the senders, into the sorted positions the rows left from.
    return_at = jnp.sum(jnp.where(jnp.arange(ep)[None, :] < me, matrix, 0), axis=1).astype(jnp.int32)
    back = exchange(y, jnp.zeros((rows, y.shape[1]), y.dtype), recv_offsets, recv_sizes, return_at, sizes)
    y_rows = jnp.zeros_like(back).at[order].set(back, unique_indices=True)  # padding rows stay 0
    out = combine(y_rows, jnp.where((dest < ep).reshape(tokens, top_k), weights, 0.0))
    if moe_tp > 1:
        out = jax.lax.psum(out, TENSOR_AXIS)
    return out, jnp.zeros((1,), jnp.int32)


def dispatch_body(options: EpMoeOptions, num_tokens: int, *, rows_ffn: RowsFfn, ep: int, moe_tp: int):
    """The per-device body `(x, slots, weights, *experts) -> (out, dropped[1])` of the dispatch
    mode `options` picks for a step of `num_tokens` tokens; `rows_ffn(x, ids, *experts,
    rows_per_token=1)` is the grouped FFN of the rows (`expert_rows_ffn`'s contract)."""
    mode = options.mode_for(num_tokens)
    if mode == "all_to_all":
        return functools.partial(
            _all_to_all_body, rows_ffn=rows_ffn, capacity_factor=options.capacity_factor, ep=ep, moe_tp=moe_tp
        )
    if mode == "ragged_all_to_all":
        return functools.partial(
            _ragged_all_to_all_body, rows_ffn=rows_ffn, ep=ep, moe_tp=moe_tp, emulate=options.ragged_emulation
        )
    return functools.partial(_allgather_body, rows_ffn=rows_ffn, moe_tp=moe_tp)


def _allgather_body(x, slots, weights, *experts, rows_ffn: RowsFfn, moe_tp: int):
    slots_per_rank = experts[0].shape[0]
    x_all = jax.lax.all_gather(x, EXPERT_AXIS, axis=0, tiled=True)
    slots_all = jax.lax.all_gather(slots, EXPERT_AXIS, axis=0, tiled=True)
    weights_all = jax.lax.all_gather(weights, EXPERT_AXIS, axis=0, tiled=True)
    local = slots_all - jax.lax.axis_index(EXPERT_AXIS) * slots_per_rank
    mine = (local >= 0) & (local < slots_per_rank)
    ids = jnp.where(mine, local, slots_per_rank)
    y = rows_ffn(x_all, ids.reshape(-1), *experts, rows_per_token=ids.shape[1])
    out = combine(y, jnp.where(mine, weights_all, 0.0))
    out = jax.lax.psum_scatter(out, EXPERT_AXIS, scatter_dimension=0, tiled=True)
    if moe_tp > 1:
        out = jax.lax.psum(out, TENSOR_AXIS)
    return out, jnp.zeros((1,), jnp.int32)


def expert_rows_operands(
    x: jax.Array, p: dict, moe_fn: MoeFn, moe_tp: int
) -> tuple[jax.Array, tuple[jax.Array, ...], RowsFfn]:
    """(x, experts, rows_ffn) for the dispatch bodies. FP8 experts go to the backend's
    `fused_fp8` as stored (e4m3 values, then their block scales, which live in the same slot
    rows as their weights: replicas and slot rewrites carry them along) when it has one and
    each `tensor` rank's share of the FFN columns is whole scale blocks; otherwise the
    experts are dequantized for `moe_fn` (`expert_operands`)."""
    fused_fp8 = fp8_experts_fn(moe_fn, p)
    if fused_fp8 is not None:
        xq, experts, block = fp8_expert_operands(x, p, fused_fp8)
        share = p["w_gate"].shape[2] // moe_tp  # each `tensor` rank's FFN columns
        if moe_tp == 1 or (share % block[0] == 0 and share % block[1] == 0):
            return xq, experts, functools.partial(fp8_expert_rows_ffn, fused_fp8=fused_fp8, block=block)
    x, w_gate, w_up, w_down = expert_operands(x, p)
    return x, (w_gate, w_up, w_down), functools.partial(expert_rows_ffn, moe_fn=moe_fn)


def ep_moe_block(
    x: jax.Array,
    p: dict,
    *,
    config: ModelConfig,
    moe_fn: MoeFn,
    mesh: jax.sharding.Mesh,
    rules: ShardingRules,
    options: EpMoeOptions = EpMoeOptions(),
    valid: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One MoE layer over slot weights: (output [T, H], expert counts int32[E], dropped rows int32[]).

    p: router [H, E], w_gate / w_up [S, H, I], w_down [S, I, H] (split as `rules` say),
    slots: the layer's `SlotTable`.
    """
    table: SlotTable = p["slots"]
    weights, ids = route_layer(x, p, config)
    ep, moe_tp = int(mesh.shape[EXPERT_AXIS]), int(mesh.shape[TENSOR_AXIS])
    x, experts, rows_ffn = expert_rows_operands(x, p, moe_fn, moe_tp)
    counts = count_experts(ids, config.num_experts, valid)
    slots = choose_slots(ids, table, valid)
    num_tokens = x.shape[0]
    padded = -(-num_tokens // ep) * ep
    if padded != num_tokens:  # every EP rank takes the same number of tokens
        extra = padded - num_tokens
        x = jnp.pad(x, ((0, extra), (0, 0)))
        slots = jnp.pad(slots, ((0, extra), (0, 0)), constant_values=table.num_slots)
        weights = jnp.pad(weights, ((0, extra), (0, 0)))
    body = dispatch_body(options, num_tokens, rows_ffn=rows_ffn, ep=ep, moe_tp=moe_tp)
    tok = P(EXPERT_AXIS)
    up_spec = logical_to_physical(("experts", "embed", "moe_mlp"), rules)
    down_spec = logical_to_physical(("experts", "moe_mlp", "embed"), rules)
    # FP8 block scales split like their weights: by slot over `expert`, by column over `tensor`.
    expert_specs = (up_spec, up_spec, down_spec) * (len(experts) // 3)
    out, dropped = jax.shard_map(
        body, mesh=mesh, in_specs=(tok, tok, tok, *expert_specs), out_specs=(tok, P()), check_vma=False
    )(x, slots, weights, *experts)
    return out[:num_tokens].astype(x.dtype), counts, dropped[0]
