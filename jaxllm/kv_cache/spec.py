"""What one token leaves in the KV cache, per layer: the device-side half of the paged cache.

The scheduler and `KVCacheManager` only deal in block ids; how big a block is and what
it holds is the `KvCacheSpec`'s business. A spec initialises the per-layer cache
pytrees, writes a step's new entries into their slots, and reports bytes per token and
per page (block) so the engine can size the pool. Attention backends take the layer
cache the spec made, so another cache layout (a latent MLA cache with one
[num_blocks, tokens_per_block, latent_dim] array per layer, say) is a new spec plus the
backends that read it: the scheduler, the KV manager and the step plan do not change.

Each spec names the logical axes of its arrays, so `sharding.rules` decides their
partitioning (the MHA cache is split by KV head under tensor parallelism; the MLA latent
cache has no head axis and is replicated: every rank's query heads read all of it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from sharding.rules import ShardingRules, logical_to_physical


class KvCacheSpec(Protocol):
    num_layers: int

    def init(
        self,
        num_blocks: int,
        tokens_per_block: int,
        mesh: Optional[jax.sharding.Mesh] = None,
        rules: Optional[ShardingRules] = None,
    ) -> list: ...

    def init_pool(
        self,
        num_blocks: int,
        tokens_per_block: int,
        mesh: Optional[jax.sharding.Mesh] = None,
        rules: Optional[ShardingRules] = None,
    ) -> Any: ...

    def write(self, cache: Any, entries: Any, slot_mapping: jax.Array) -> Any: ...

    def partition_spec(self, rules: ShardingRules) -> Any: ...

    def bytes_per_token(self, num_shards: int = 1) -> int: ...

    def page_bytes(self, tokens_per_block: int, num_shards: int = 1) -> int: ...


@jax.tree_util.register_dataclass
@dataclass
class MhaLayerCache:
    """One layer's keys and values, each [num_kv_heads, num_blocks, tokens_per_block, head_dim]."""

    k: jax.Array
    v: jax.Array


MHA_CACHE_AXES = ("kv_heads", "cache_blocks", "cache_tokens", "head_dim")


@dataclass(frozen=True)
class MhaKvCacheSpec:
    """Separate K and V per KV head (Llama, Qwen, Mixtral). `num_kv_heads` counts stored heads,
    replicas included (see `sharding.rules.kv_head_replicas`)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def init(
        self,
        num_blocks: int,
        tokens_per_block: int,
        mesh: Optional[jax.sharding.Mesh] = None,
        rules: Optional[ShardingRules] = None,
    ) -> list[MhaLayerCache]:
        """Zeroed per-layer caches, created already sharded when a mesh is given."""
        zeros = self._zeros((self.num_kv_heads, num_blocks, tokens_per_block, self.head_dim), mesh, rules)
        return [MhaLayerCache(zeros(), zeros()) for _ in range(self.num_layers)]

    def init_pool(
        self,
        num_blocks: int,
        tokens_per_block: int,
        mesh: Optional[jax.sharding.Mesh] = None,
        rules: Optional[ShardingRules] = None,
    ) -> MhaLayerCache:
        """One zeroed cache for all layers, each [num_kv_heads, num_layers * num_blocks,
        tokens_per_block, head_dim]: layer i owns pages [i * num_blocks, (i + 1) * num_blocks).
        Attention and the KV write see one layer through its page and slot offset
        (`jaxllm.models.layer_runner.layer_metadata`), so a scan over layers carries this one
        buffer and updates it in place, and the kernels need no layer argument."""
        zeros = self._zeros(
            (self.num_kv_heads, self.num_layers * num_blocks, tokens_per_block, self.head_dim), mesh, rules
        )
        return MhaLayerCache(zeros(), zeros())

    def _zeros(self, shape: tuple[int, ...], mesh: Optional[jax.sharding.Mesh], rules: Optional[ShardingRules]) -> Any:
        dt = jnp.dtype(self.dtype)
        if mesh is None:
            return lambda: jnp.zeros(shape, dt)
        sharding = jax.sharding.NamedSharding(mesh, logical_to_physical(MHA_CACHE_AXES, rules or ShardingRules()))
        return jax.jit(lambda: jnp.zeros(shape, dt), out_shardings=sharding)

    def write(
        self, cache: MhaLayerCache, entries: tuple[jax.Array, jax.Array], slot_mapping: jax.Array
    ) -> MhaLayerCache:
        """Scatter this step's (k, v), each [T, Hkv, D], into their slots; padding slots
        (== num_blocks * tokens_per_block) are dropped."""
        num_kv_heads, num_blocks, tokens_per_block, head_dim = cache.k.shape
        flat_shape = (num_kv_heads, num_blocks * tokens_per_block, head_dim)

        def scatter(buf: jax.Array, new: jax.Array) -> jax.Array:
            flat = buf.reshape(flat_shape)
            flat = flat.at[:, slot_mapping].set(jnp.swapaxes(new, 0, 1).astype(buf.dtype), mode="drop")
            return flat.reshape(buf.shape)

        k, v = entries
        return MhaLayerCache(scatter(cache.k, k), scatter(cache.v, v))

    def partition_spec(self, rules: ShardingRules) -> MhaLayerCache:
        spec = logical_to_physical(MHA_CACHE_AXES, rules)
        # the cache's pytree with PartitionSpec leaves (the shardings jit takes), not arrays
        return MhaLayerCache(spec, spec)  # type: ignore[arg-type]

    def bytes_per_token(self, num_shards: int = 1) -> int:
        """Bytes one token takes across all layers on one device, with the KV heads split in
        `num_shards` (the tensor-parallel size)."""
        if self.num_kv_heads % num_shards:
            raise ValueError(f"{self.num_kv_heads} KV heads do not split over {num_shards} devices")
        itemsize = np.dtype(jnp.dtype(self.dtype)).itemsize
        return 2 * self.num_layers * (self.num_kv_heads // num_shards) * self.head_dim * itemsize

    def page_bytes(self, tokens_per_block: int, num_shards: int = 1) -> int:
        return self.bytes_per_token(num_shards) * tokens_per_block


@jax.tree_util.register_dataclass
@dataclass
class MlaLayerCache:
    """One layer's multi-head latent attention cache, [num_blocks, tokens_per_block, latent_dim]:
    per token the normalised compressed KV (kv_lora_rank) followed by the RoPE'd shared key
    (qk_rope_head_dim)."""

    latent: jax.Array


MLA_CACHE_AXES = ("cache_blocks", "cache_tokens", None)


@dataclass(frozen=True)
class MlaKvCacheSpec:
    """The latent cache of DeepSeek-V3's MLA: one [kv_lora_rank + qk_rope_head_dim] vector per
    token and layer instead of K and V for every head. Attention either absorbs the key and
    value up-projections into the query and output (decode) or expands the latent back to
    per-head K/V (prefill); see `jaxllm.models.mla`."""

    num_layers: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: str

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def init(
        self,
        num_blocks: int,
        tokens_per_block: int,
        mesh: Optional[jax.sharding.Mesh] = None,
        rules: Optional[ShardingRules] = None,
    ) -> list[MlaLayerCache]:
        shape = (num_blocks, tokens_per_block, self.latent_dim)
        dt = jnp.dtype(self.dtype)
        if mesh is None:
            return [MlaLayerCache(jnp.zeros(shape, dt)) for _ in range(self.num_layers)]
        sharding = jax.sharding.NamedSharding(mesh, logical_to_physical(MLA_CACHE_AXES, rules or ShardingRules()))
        zeros = jax.jit(lambda: jnp.zeros(shape, dt), out_shardings=sharding)
        return [MlaLayerCache(zeros()) for _ in range(self.num_layers)]

    def init_pool(
        self,
        num_blocks: int,
        tokens_per_block: int,
        mesh: Optional[jax.sharding.Mesh] = None,
        rules: Optional[ShardingRules] = None,
    ) -> MlaLayerCache:
        """One zeroed latent cache for all layers, [num_layers * num_blocks, tokens_per_block,
        latent_dim]: layer i owns pages [i * num_blocks, (i + 1) * num_blocks), as in
        `MhaKvCacheSpec.init_pool` (the layer scan carries it and writes it in place)."""
        shape = (self.num_layers * num_blocks, tokens_per_block, self.latent_dim)
        dt = jnp.dtype(self.dtype)
        if mesh is None:
            return MlaLayerCache(jnp.zeros(shape, dt))
        sharding = jax.sharding.NamedSharding(mesh, logical_to_physical(MLA_CACHE_AXES, rules or ShardingRules()))
        return MlaLayerCache(jax.jit(lambda: jnp.zeros(shape, dt), out_shardings=sharding)())

    def write(self, cache: MlaLayerCache, entries: jax.Array, slot_mapping: jax.Array) -> MlaLayerCache:
        """Scatter this step's latents [T, latent_dim] into their slots; padding slots are dropped."""
        num_blocks, tokens_per_block, dim = cache.latent.shape
        flat = cache.latent.reshape(num_blocks * tokens_per_block, dim)
        flat = flat.at[slot_mapping].set(entries.astype(flat.dtype), mode="drop")
        return MlaLayerCache(flat.reshape(cache.latent.shape))

    def partition_spec(self, rules: ShardingRules) -> MlaLayerCache:
        # the cache's pytree with PartitionSpec leaves (the shardings jit takes), not arrays
        return MlaLayerCache(logical_to_physical(MLA_CACHE_AXES, rules))  # type: ignore[arg-type]

    def bytes_per_token(self, num_shards: int = 1) -> int:
        """Bytes one token takes across all layers on one device (the same on every
        tensor-parallel rank: the latent is not split)."""
        itemsize = np.dtype(jnp.dtype(self.dtype)).itemsize
        return self.num_layers * self.latent_dim * itemsize

    def page_bytes(self, tokens_per_block: int, num_shards: int = 1) -> int:
        return self.bytes_per_token(num_shards) * tokens_per_block
