"""The weight declaration and sharded loading: what is derived from it agrees, shards are read
alone, and the orbax format restores the same arrays into the requested shardings."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxllm.models import ModelConfig, declare_weights, load_params, param_bytes, param_shapes, partition_specs
from jaxllm.models.random_checkpoint import random_checkpoint
from jaxllm.models.weight_reading import read_parameter
from jaxllm.models.weights import declare_params
from sharding import ShardingRules
from tests.multidevice import run_on_cpu_devices
from tests.test_sharding_tp import hf_config, write_checkpoint


def _full_parameter(decl, alt, tensors, dtype=np.float32):
    return read_parameter(decl, alt, (), lambda name, sl: tensors[name][sl], np.dtype(dtype))


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("kv_replicas", [1, 4])
def test_reading_any_box_equals_slicing_the_whole_parameter(arch, kv_replicas):
    """Every layout (head splits, transposes, fused halves, per-expert parts, repeated KV heads)
    read box by box gives the same numbers as the whole parameter, sliced."""
    config = ModelConfig.from_hf_config(hf_config(arch))
    tensors = random_checkpoint(config, seed=3)
    rng = np.random.default_rng(0)
    for decl in declare_weights(config, kv_replicas):
        alt = decl.alternatives[0]
        whole = _full_parameter(decl, alt, tensors)
        assert whole.shape == decl.shape
        for _ in range(3):
            box = []
            for n in decl.shape:
                a = int(rng.integers(0, n))
                box.append(slice(a, int(rng.integers(a + 1, n + 1))))
            np.testing.assert_array_equal(
                _full_parameter(decl, alt, tensors)[tuple(box)],
                read_parameter(decl, alt, tuple(box), lambda name, sl: tensors[name][sl], np.dtype(np.float32)),
            )
    # Repeated KV heads are the original heads, each `kv_replicas` times in a row.
    k = next(d for d in declare_weights(config, kv_replicas) if d.path[-1] == "k")
    k1 = next(d for d in declare_weights(config, 1) if d.path[-1] == "k")
    np.testing.assert_array_equal(
        _full_parameter(k, k.alternatives[0], tensors),
        np.repeat(_full_parameter(k1, k1.alternatives[0], tensors), kv_replicas, axis=1),
    )


def test_derived_views_agree_with_the_loaded_tree(tmp_path):
    config = ModelConfig.from_hf_config(hf_config("qwen3_moe"))
    directory = write_checkpoint("qwen3_moe", tmp_path / "m")
    params = load_params(directory, config)
    shapes = param_shapes(config)
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(shapes)
    assert jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), params) == jax.tree_util.tree_map(
        lambda s: (s.shape, s.dtype), shapes
    )
    assert param_bytes(config) == sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    P = jax.sharding.PartitionSpec
    specs = partition_specs(replace(config, scan_layers=False), ShardingRules())
    assert specs["layers"][0]["attn"]["q"] == P(None, "tensor", None)
    assert specs["layers"][0]["attn"]["o"] == P("tensor", None, None)
    assert specs["layers"][1]["moe"]["w_down"] == P(None, "tensor", None)
    assert specs["embed"] == P("tensor", None)
    # Layer stacks (scan_layers): the same specs behind an unsharded layer axis.
    stacked = partition_specs(config, ShardingRules())
    assert stacked["layers"] == [{}] * config.num_layers and len(stacked["layer_stacks"]) == 2  # dense, MoE
    assert stacked["layer_stacks"][0]["attn"]["q"] == P(None, None, "tensor", None)
    assert stacked["layer_stacks"][1]["moe"]["w_down"] == P(None, None, "tensor", None)
    # The random checkpoint is exactly the canonical spelling of every parameter.
    canonical = {src.name for d in declare_weights(config) for src in d.alternatives[0]}
    assert set(random_checkpoint(config, 0)) == canonical


def check_sharded_loading(root: Path) -> None:
    """Subprocess entry point (8 devices): per-shard reads, host memory, orbax round trip."""
    import tracemalloc

    from jaxllm.models import load_model_config
    from jaxllm.models.convert import convert_checkpoint
    from sharding import ParallelConfig, make_mesh

    assert len(jax.devices()) == 8
    directory = write_checkpoint("qwen3_moe", root / "m")
    # Make the embedding dominate: a real vocabulary size, so the host peak is measurable.
    hf = dict(hf_config("qwen3_moe"), vocab_size=16384, hidden_size=64)
    (directory / "config.json").write_text(json.dumps(hf))
    from safetensors.numpy import save_file

    config = ModelConfig.from_hf_config(hf)
    tensors = random_checkpoint(config, seed=1)
    save_file(tensors, str(directory / "model.safetensors"))
    del tensors
    config = load_model_config(directory)
    mesh = make_mesh(ParallelConfig(tensor_parallel_size=8))

    reads: list[tuple[str, int]] = []
    tracemalloc.start()
    params = load_params(
        directory, config, mesh=mesh, slice_hook=lambda name, slices, array: reads.append((name, array.nbytes))
    )
    # On CPU a device buffer may be the very numpy array it was made from, so what stays
    # allocated after the load is the parameters themselves; the transient host memory of
    # loading is the peak above that.
    resident, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    embed_bytes = config.vocab_size * config.hidden_size * 4
    max_embed_read = max(n for name, n in reads if name == "model.embed_tokens.weight")
    print(
        json.dumps(
            dict(
                kind="host",
                peak=peak,
                transient=peak - resident,
                resident=resident,
                embed_bytes=embed_bytes,
                max_embed_read=max_embed_read,
                embed_reads=sum(1 for name, _ in reads if name == "model.embed_tokens.weight"),
                embed_spec=list(params["embed"].sharding.spec),
            )
        ),
        flush=True,
    )
    # Every sharded parameter: no read bigger than one device's shard of its tensor.
    sizes = {name: n for name, n in reads}
    worst = 0.0
    for decl in declare_params(config, 4):  # 2 KV heads on 8 ranks: 4 replicas
        leaf = params
        for key in decl.path:
            leaf = leaf[key]
        members = getattr(decl, "members", (decl,))  # a layer stack is read layer by layer
        shard_bytes = leaf.addressable_shards[0].data.nbytes // len(members)
        if shard_bytes < leaf.nbytes // len(members):
            names = set().union(*(m.checkpoint_names for m in members))
            biggest = max(n for name, n in reads if name in names)
            worst = max(worst, biggest / shard_bytes)
    print(json.dumps(dict(kind="shards", worst_read_over_shard=worst, num_tensors=len(sizes))), flush=True)

    # Orbax: convert once, restore into TP 8 (KV heads replicated), TP 2, expert parallelism with
    # the default placement and with redundant slots, and attention DP's replicated attention.
    from jaxllm.engine.load_balancer import moe_layer_params, slot_layer_row
    from jaxllm.models.partitioning import attention_dp_rules

    converted = convert_checkpoint(directory, root / "converted")
    redundant = {1: [3, 1, 0, 2, 0, 1]}  # the 4 experts in 6 slots over 2 ranks
    for tp, ep, placement, dp in (
        (8, None, None, False),
        (2, None, None, False),
        (8, 4, None, False),
        (8, 2, redundant, False),
        (8, 2, None, True),
    ):
        mesh = make_mesh(ParallelConfig(tensor_parallel_size=tp, moe_expert_parallel_size=ep))
        kwargs = dict(mesh=mesh, slot_assignments=placement, rules=attention_dp_rules(config, mesh) if dp else None)
        expected = load_params(directory, config, **kwargs)
        restored = load_params(converted, config, **kwargs)
        same_values = jax.tree_util.tree_all(
            jax.tree_util.tree_map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), restored, expected)
        )
        same_shardings = jax.tree_util.tree_all(
            jax.tree_util.tree_map(lambda a, b: a.sharding.is_equivalent_to(b.sharding, a.ndim), restored, expected)
        )
        stacks = restored.get("layer_stacks") or []
        k = stacks[0]["attn"]["k"] if stacks else restored["layers"][0]["attn"]["k"]
        moe = moe_layer_params(restored, 1)  # layer 1's own, or its stack's [n, slots, ...]
        slot_axis = 0 if slot_layer_row(restored, 1) is None else 1
        print(
            json.dumps(
                dict(
                    kind="orbax",
                    tp=tp,
                    ep=ep,
                    dp=dp,
                    same_values=same_values,
                    same_shardings=same_shardings,
                    slots=[moe["w_gate"].shape[slot_axis]] if "slots" in moe else None,
                    k_spec=str(k.sharding.spec),
                    k_shape=list(k.shape[1:] if stacks else k.shape),
                )
            ),
            flush=True,
        )


def test_sharded_loading_and_orbax_round_trip(tmp_path):
    out = run_on_cpu_devices("test_weights", "check_sharded_loading", tmp_path, timeout=600)
    host = next(r for r in out if r["kind"] == "host")
    assert host["embed_spec"] == ["tensor", None]
    assert host["embed_reads"] == 8 and host["max_embed_read"] * 8 == host["embed_bytes"]
    # Transient host memory of the whole load stays well under one full copy of the embedding.
    assert host["transient"] < 0.5 * host["embed_bytes"], host
    shards = next(r for r in out if r["kind"] == "shards")
    assert shards["worst_read_over_shard"] <= 1.0, shards
    orbax = [r for r in out if r["kind"] == "orbax"]
    assert len(orbax) == 5
    for r in orbax:
        assert r["same_values"] and r["same_shardings"], r
    assert orbax[0]["k_shape"][1] == 8 and "tensor" in orbax[0]["k_spec"]
    assert [r["slots"] for r in orbax[2:4]] == [[4], [6]], "EP layouts restore the experts as slots"
    assert orbax[4]["k_shape"][1] == 2 and "tensor" not in orbax[4]["k_spec"], "attention DP: k replicated"
