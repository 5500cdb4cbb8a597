"""Partition rules, and the sharded models of `mesh_cases.py` on eight CPU devices."""

from __future__ import annotations

import pathlib

import jax
import pytest
from jax.sharding import PartitionSpec as P

from dualpath_jax.model import sharding
from dualpath_jax.presets import TINY_DEEPSEEK, TINY_QWEN2

HERE = pathlib.Path(__file__).resolve().parent


def test_parse_mesh_orders_axes_and_rejects_bad_specs():
    assert sharding.parse_mesh("tensor=4, data=2") == {"data": 2, "tensor": 4}
    assert sharding.parse_mesh("") == {}
    assert sharding.mesh_size("data=2,expert=4") == 8
    for bad, says in [
        ("tensor", "axis=size"),
        ("model=2", "not one of"),
        ("tensor=0", "sizes must be >= 1"),
        ("tensor=2,tensor=2", "twice"),
    ]:
        with pytest.raises(ValueError, match=says):
            sharding.parse_mesh(bad)


def test_make_mesh_needs_enough_devices():
    assert sharding.make_mesh("") is None
    with pytest.raises(ValueError, match="needs 64 devices"):
        sharding.make_mesh("tensor=64")


def test_spec_splits_only_whole_units():
    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "tensor"))
    heads = {"heads": 4, "kv_heads": 2}
    assert sharding.spec_for((None, "heads"), (64, 64), mesh, heads) == P(None, "tensor")
    # 2 KV heads do not split 4 ways: replicated, not cut inside a head
    assert sharding.spec_for((None, "kv_heads"), (64, 32), mesh, heads) == P()
    assert sharding.spec_for(("vocab", None), (257, 64), mesh) == P()  # 257 % 4
    assert sharding.spec_for(("batch", None), (6, 64), mesh) == P("data")
    assert sharding.spec_for(("experts", None), (8, 64), mesh) == P()  # no expert axis


def test_every_parameter_path_has_a_rule_of_its_rank():
    from flax import nnx

    from dualpath_jax.model.transformer import Transformer

    mesh = jax.sharding.AbstractMesh((1, 2, 2), ("data", "tensor", "expert"))
    for cfg in (TINY_QWEN2, TINY_DEEPSEEK):
        tree = nnx.to_pure_dict(
            nnx.state(nnx.eval_shape(lambda c=cfg: Transformer(c, rngs=nnx.Rngs(0))))
        )
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            logical = sharding.param_logical_axes(sharding._path(path), len(leaf.shape))
            sharding.spec_for(logical, leaf.shape, mesh, sharding.units(cfg))


def test_kv_rows_shard_by_head_for_gqa_scaled_or_not():
    import dataclasses

    assert sharding.kv_logical_axes(TINY_QWEN2) == "kv_heads"
    assert sharding.kv_logical_axes(TINY_DEEPSEEK) is None  # MLA latent: replicated
    scaled = dataclasses.replace(TINY_QWEN2, kv_dtype="float8_e4m3fn", kv_scales=True)
    assert sharding.kv_logical_axes(scaled) == "kv_heads"  # each head's scales in its columns


@pytest.mark.slow
def test_sharded_models_on_eight_cpu_devices(run_on_cpu_devices):
    """`mesh_cases.py` in a process with 8 CPU devices: tokens on 2x4 and expert-parallel meshes
    equal one device's, every family read from transformers' checkpoints onto 1x8 and 2x4 meshes
    gives transformers' tokens, every parameter and KV page is where the rules put it."""
    run_on_cpu_devices(HERE / "mesh_cases.py", 8)
