"""An engine's model on its mesh, in a process with 4 CPU devices: run by `test_engine_mesh.py`
with `XLA_FLAGS=--xla_force_host_platform_device_count=4` (set before JAX starts). Not
collected by a plain `pytest tests`."""

from __future__ import annotations

import dataclasses

import jax
import pytest
from flax import nnx

from dualpath_jax.config import ClusterConfig, ExperimentConfig, StoreConfig
from dualpath_jax.engines.common import runner_devices
from dualpath_jax.engines.decode_engine import make_decoder
from dualpath_jax.engines.params import ParamsSlot, load_served_model
from dualpath_jax.model import sharding
from dualpath_jax.model.checkpoint import save_params_tree
from dualpath_jax.model.generation import generate
from dualpath_jax.model.runner import ModelRunner
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import TINY_QWEN2
from dualpath_jax.wire import messages

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (CPU) devices")

CFG = dataclasses.replace(TINY_QWEN2, num_heads=8, num_kv_heads=4, head_dim=8)
PROMPT = [5, 17, 42, 9, 250, 3, 77, 120, 8, 61, 33]


def _shardings(net) -> dict:
    flat = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(net)))
    return {sharding._path(k): leaf.sharding for k, leaf in flat}


@pytest.mark.parametrize("from_checkpoint", [False, True], ids=["init", "checkpoint"])
def test_the_served_model_is_placed_on_the_engines_mesh(tmp_path, from_checkpoint):
    """`load_served_model(cfg, mesh)`: `init_model` on the mesh, or a checkpoint's parameters
    placed by the partition rules; its tokens are the one-device model's, and the engine reports
    the mesh's devices."""
    ref = init_model(CFG, seed=3)
    cluster = ClusterConfig()
    if from_checkpoint:
        save_params_tree(ref, tmp_path / "ckpt")
        cluster = ClusterConfig(params_path=str(tmp_path / "ckpt"))
    cfg = ExperimentConfig(model=CFG, cluster=cluster, seed=3)
    mesh = sharding.make_mesh("data=2,tensor=2")
    net = load_served_model(cfg, mesh)
    pure = nnx.to_pure_dict(nnx.state(net))
    want = sharding.param_shardings(pure, mesh, CFG)
    flat = dict(zip(_shardings(net), jax.tree.leaves(want)))
    assert _shardings(net) == flat
    assert _shardings(net)["layers/0/self_attn/k_proj/kernel"].spec == jax.sharding.PartitionSpec(
        None, "tensor"
    )
    runner = ModelRunner(net)
    assert runner_devices(runner) == (["cpu:0", "cpu:1", "cpu:2", "cpu:3"], "data=2,tensor=2")
    assert generate(runner, PROMPT, 6) == generate(ref, PROMPT, 6)


def test_params_updates_stay_on_the_mesh(tmp_path):
    """A params update (loaded from a checkpoint, one device's arrays) is placed on the
    engine's mesh when it is committed."""
    runner = ModelRunner(init_model(CFG, seed=0, mesh=sharding.make_mesh("tensor=4")))
    new = init_model(CFG, seed=9)
    save_params_tree(new, tmp_path / "v2")
    slot = ParamsSlot(runner, "", 0)
    assert slot.stage(messages.LoadParams(version="v2", path=str(tmp_path / "v2"))).ok
    slot.commit(messages.CommitParams(version="v2", commit=True))
    kernel = runner.layer_states[0]["self_attn"]["q_proj"]["kernel"][...]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
    assert generate(runner, PROMPT, 6) == generate(new, PROMPT, 6)


def test_decode_pool_on_the_mesh():
    """The DE's pool is split by KV head; a byte budget counts the pool on all its devices."""
    runner = ModelRunner(init_model(CFG, seed=0, mesh=sharding.make_mesh("tensor=2")))
    page = 4 * CFG.num_layers * 16 * CFG.kv_width  # one Full Block of float32 KV
    cfg = ExperimentConfig(
        model=CFG,
        cluster=ClusterConfig(decode_slots=2, decode_max_len=256, decode_kv_bytes=10 * page),
        store=StoreConfig(block_tokens=16),
    )
    dec = make_decoder(cfg, runner)
    assert dec.num_pages == 10
    assert dec.pages.sharding.spec == jax.sharding.PartitionSpec(None, None, None, "tensor")
    assert dec.pages.addressable_shards[0].data.shape[-1] == CFG.kv_width // 2
