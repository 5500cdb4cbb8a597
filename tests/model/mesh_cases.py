"""Sharded models on eight CPU devices: run by `test_sharding.py` in a process of its own with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (the flag must be set before JAX starts,
and the rest of the suite runs on one device). Not collected by a plain `pytest tests`.

Each case builds a model on a mesh and checks it against the same model on one device: greedy
tokens identical, every parameter and KV page where the partition rules put it.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dualpath_jax import model as dm
from dualpath_jax.model import sharding
from dualpath_jax.model.cached_kv import CachedPages, LayerPages
from dualpath_jax.model.decode import Decoder
from dualpath_jax.model.runner import ModelRunner, PrefillBatch

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (CPU) devices")

# Tiny models whose heads, KV heads, vocabulary and MLP divide by 8, so every rule shards.
QWEN = dataclasses.replace(
    dm.get_preset("tiny-qwen2"),
    num_heads=8,
    num_kv_heads=8,
    head_dim=8,
    vocab_size=256,
    intermediate_size=128,
)
DEEPSEEK = dataclasses.replace(
    dm.get_preset("tiny-deepseek"),
    num_heads=8,
    num_kv_heads=8,
    vocab_size=256,
    intermediate_size=128,
)
MODELS = {"qwen2": QWEN, "deepseek": DEEPSEEK}
MESHES = {"1x8": "data=1,tensor=8", "2x4": "data=2,tensor=4", "ep": "data=2,expert=4"}
PROMPTS = [[5, 17, 42, 9, 250, 3, 77, 120, 8, 61, 33], [9, 8, 7, 6]]


@pytest.fixture(scope="module")
def reference():
    """Per model: the one-device model and its greedy tokens."""
    out = {}
    for name, cfg in MODELS.items():
        net = dm.init_model(cfg, seed=0)
        out[name] = (net, dm.generate(net, PROMPTS, 10))
    return out


def _sharded(name: str, mesh_name: str):
    return dm.init_model(MODELS[name], seed=0, mesh=sharding.make_mesh(MESHES[mesh_name]))


def _specs(net) -> dict[str, P]:
    flat = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(net)))
    return {sharding._path(k): leaf.sharding.spec for k, leaf in flat}


# 1x8 and 2x4 tokens of every family are also checked against transformers below.
@pytest.mark.parametrize("mesh_name", ["2x4", "ep"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_sharded_greedy_tokens_equal_one_device(reference, name, mesh_name):
    net = _sharded(name, mesh_name)
    assert dm.generate(net, PROMPTS, 10) == reference[name][1]


EXPECTED_TP = {  # tensor = 4 or 8: Megatron column / row splits, the vocabulary split
    "embed/embedding": P("tensor"),
    "head/lm_head/kernel": P(None, "tensor"),
    "head/norm/weight": P(),
    "layers/0/input_layernorm/weight": P(),
    "layers/0/mlp/gate_proj/kernel": P(None, "tensor"),
    "layers/0/mlp/up_proj/kernel": P(None, "tensor"),
    "layers/0/mlp/down_proj/kernel": P("tensor"),
}
EXPECTED_QWEN = {
    "layers/1/self_attn/q_proj/kernel": P(None, "tensor"),
    "layers/1/self_attn/q_proj/bias": P("tensor"),
    "layers/1/self_attn/k_proj/kernel": P(None, "tensor"),
    "layers/1/self_attn/v_proj/bias": P("tensor"),
    "layers/1/self_attn/o_proj/kernel": P("tensor"),
}
EXPECTED_DEEPSEEK = {
    "layers/1/self_attn/q_a_proj/kernel": P(),
    "layers/1/self_attn/q_b_proj/kernel": P(None, "tensor"),
    "layers/1/self_attn/kv_a_proj_with_mqa/kernel": P(),
    "layers/1/self_attn/w_uk": P(None, "tensor"),
    "layers/1/self_attn/w_uv": P(None, "tensor"),
    "layers/1/self_attn/o_proj/kernel": P("tensor"),
    "layers/1/mlp/router": P(),
    "layers/1/mlp/w_gate": P(None, None, "tensor"),
    "layers/1/mlp/w_down": P(None, "tensor"),
    "layers/1/mlp/shared/gate_proj/kernel": P(None, "tensor"),
}


@pytest.mark.parametrize("mesh_name", ["1x8", "2x4"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_parameter_has_its_expected_sharding(name, mesh_name):
    net = _sharded(name, mesh_name)
    got = _specs(net)
    want = {**EXPECTED_TP, **(EXPECTED_QWEN if name == "qwen2" else EXPECTED_DEEPSEEK)}
    assert {k: got[k] for k in want} == want
    # and every other parameter as the rules say (the norms replicated)
    assert got == sharding.param_specs(nnx.to_pure_dict(nnx.state(net)), net_mesh(net))
    assert all(v == P() for k, v in got.items() if k.endswith("norm/weight"))


def net_mesh(net):
    return sharding.model_mesh(nnx.state(net))


def test_experts_split_over_the_expert_axis():
    net = _sharded("deepseek", "ep")
    got = _specs(net)
    assert got["layers/1/mlp/w_gate"] == P("expert")
    assert got["layers/1/mlp/w_down"] == P("expert")
    assert got["layers/1/self_attn/q_b_proj/kernel"] == P()  # no tensor axis: replicated
    # each device holds 2 of the 8 experts
    shard = net.layers[1].mlp.w_gate[...].addressable_shards[0]
    assert shard.data.shape[0] == DEEPSEEK.n_routed_experts // 4


def test_expert_parallel_layer_runs_under_shard_map_with_one_all_reduce():
    mesh = sharding.make_mesh(MESHES["ep"])
    moe = _sharded("deepseek", "ep").layers[1].mlp
    x = jax.random.normal(jax.random.key(1), (2, 5, DEEPSEEK.hidden_size))
    ref = dm.init_model(DEEPSEEK, seed=0).layers[1].mlp(x)
    with jax.set_mesh(mesh):
        fn = jax.jit(lambda x: moe(x))
        got = fn(x)
        hlo = fn.lower(x).compile().as_text()
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, rtol=1e-5)
    assert "all-gather" not in hlo  # the experts' weights never move
    assert hlo.count("all-reduce") >= 1


@pytest.mark.parametrize("name", sorted(MODELS))
def test_kv_pages_and_rows_have_their_sharding(name):
    """GQA: the decode pool and the new KV rows split by KV head over `tensor` (rows over
    `data` by request); MLA's latent replicated."""
    cfg = MODELS[name]
    net = _sharded(name, "2x4")
    runner = ModelRunner(net)
    batch = PrefillBatch.build(cfg, PROMPTS, [0, 0])
    _, kv = runner.prefill_monolithic(batch)
    dec = Decoder(runner, 2, 64, page_size=16)
    width = "tensor" if name == "qwen2" else None
    assert kv.sharding.spec == (P(None, "data", None, "tensor") if width else P(None, "data"))
    assert dec.pages.sharding.spec == (P(None, None, None, "tensor") if width else P())
    kv = np.asarray(kv)
    for b, p in enumerate(PROMPTS):
        dec.insert(b, kv[:, b], len(p), 1)
    for _ in range(3):
        dec.step()
    assert dec.pages.sharding.spec == (P(None, None, None, "tensor") if width else P())
    if width:  # a device holds 8 / 4 = 2 KV heads of the row: 2 x (K | V) x head_dim
        assert dec.pages.addressable_shards[0].data.shape[-1] == 2 * 2 * cfg.head_dim


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forks_on_a_mesh_give_the_one_device_tokens(reference, name):
    """A fork of a prompt (shared pages, the last one copied) on the 2x4 mesh's split pool
    generates the prompt's one-device greedy tokens; the pool keeps its sharding."""
    cfg, one_device = MODELS[name], reference[name][0]
    runner = ModelRunner(_sharded(name, "2x4"))
    prompt = PROMPTS[0] * 3  # 33 tokens: its last one starts the third 16-token page
    _, kv = runner.prefill_monolithic(PrefillBatch.build(cfg, [prompt], [0]))
    dec = Decoder(runner, 2, 64, page_size=16)
    spec = dec.pages.sharding.spec
    dec.insert(0, np.asarray(kv)[:, 0], len(prompt), 1)
    dec.hold("g", 0, len(prompt))
    dec.free(0)
    dec.fork(1, "g", len(prompt), prompt[-1])
    got = [int(np.asarray(dec.advance())[1]) for _ in range(4)]
    assert got == dm.generate(one_device, [prompt], 4)[0]
    assert dec.pages.sharding.spec == spec


def test_scaled_fp8_pages_split_by_kv_head_with_their_scales():
    """fp8 KV with per-token scales on 2x4: each head's scales sit in its own columns, so the
    decode pool and the new rows split over `tensor` like bf16 ones (a device holds 2 heads of
    K | V | their two scales) and the paged kernel reads its share; tokens equal one device's."""
    cfg = dataclasses.replace(
        QWEN, kv_dtype="float8_e4m3fn", kv_scales=True, attention_impl="pallas"
    )
    want = dm.generate(dm.init_model(cfg, seed=0), PROMPTS, 8)
    net = dm.init_model(cfg, seed=0, mesh=sharding.make_mesh(MESHES["2x4"]))
    assert dm.generate(net, PROMPTS, 8) == want
    runner = ModelRunner(net)
    _, kv = runner.prefill_monolithic(PrefillBatch.build(cfg, PROMPTS, [0, 0]))
    assert kv.sharding.spec == P(None, "data", None, "tensor")
    dec = Decoder(runner, 2, 64, page_size=16)
    assert dec.pages.sharding.spec == P(None, None, None, "tensor")
    assert dec.pages.addressable_shards[0].data.shape[-1] == 2 * (2 * cfg.head_dim + 8)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_layerwise_and_program_prefill_on_a_mesh_equal_one_device(reference, name):
    """Prefill over cached KV: the per-layer loop with pages and the one-program forward with
    pinned-host pages on a 2x4 mesh give the one-device logits."""
    cfg = MODELS[name]
    base = ModelRunner(reference[name][0])
    runner = ModelRunner(_sharded(name, "2x4"))
    ctx = [list(range(3, 3 + 40)), list(range(100, 100 + 23))]
    first = PrefillBatch.build(cfg, ctx, [0, 0])
    _, kv = base.prefill_monolithic(first)
    kv = np.asarray(kv)
    tail = PrefillBatch.build(cfg, [[7, 8, 9], [1, 2]], [40, 23])
    layers = [
        LayerPages.from_rows(
            [kv[i, b, : len(c)] for b, c in enumerate(ctx)], 16, cfg.kv_width, kv.dtype
        )
        for i in range(cfg.num_layers)
    ]
    want = np.asarray(base.prefill_layerwise(tail, lambda i: layers[i]).last_logits)
    got = np.asarray(runner.prefill_layerwise(tail, lambda i: layers[i]).last_logits)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    pages = CachedPages.from_layers(layers)
    at = runner.pages_sharding(pages.pages.shape)
    res, _ = runner.prefill_program(tail, pages.to_host(at))
    np.testing.assert_allclose(np.asarray(res.last_logits), want, rtol=2e-5, atol=2e-5)
    assert np.array_equal(np.argmax(got, -1), np.argmax(want, -1))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_mixed_batch_packs_on_a_tensor_mesh_and_not_over_data(reference, name):
    """Packed prefill (model/packing.py) on 1x8 gives the one-device padded logits; a mesh with
    a `data` axis keeps the padded layout (its requests split over `data`)."""
    cfg = MODELS[name]
    base = ModelRunner(reference[name][0], pack=False)
    runner = ModelRunner(_sharded(name, "1x8"))
    batch = PrefillBatch.build(cfg, [list(range(3, 43)), [9, 8], [7], [1, 2, 3]], [0] * 4)
    assert runner.pack and batch.packed() is not None
    assert not ModelRunner(_sharded(name, "2x4")).pack
    want, want_kv = base.prefill_monolithic(batch)
    got, kv = runner.prefill_monolithic(batch)
    np.testing.assert_allclose(
        np.asarray(got.last_logits), np.asarray(want.last_logits), rtol=2e-5, atol=2e-5
    )
    for b, n in enumerate(batch.new_lens):
        np.testing.assert_allclose(np.asarray(kv)[:, b, :n], np.asarray(want_kv)[:, b, :n],
                                   rtol=2e-5, atol=2e-5)  # fmt: skip


def test_explicit_mesh_from_jax_make_mesh_is_accepted():
    """`jax.make_mesh` gives Explicit axes; the model takes its devices and names as Auto."""
    mesh = jax.make_mesh((2, 4), ("data", "tensor"))
    net = dm.init_model(QWEN, seed=0, mesh=mesh)
    assert net.embed.embedding[...].sharding.mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2
    assert dm.generate(net, PROMPTS[0], 4) == dm.generate(
        dm.init_model(QWEN, seed=0), PROMPTS[0], 4
    )


# --------------------------------------------------------------------------- from_pretrained

# transformers architecture, (test module, its config dict), overrides: heads that split 8 ways
HF_FAMILIES = {
    "qwen2": ("Qwen2ForCausalLM", ("test_hf", "QWEN2"), {}),
    "qwen3": ("Qwen3ForCausalLM", ("test_hf_families", "QWEN3"), {}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", ("test_hf_families", "QWEN3_MOE"), {}),
    "deepseek_v2": ("DeepseekV2ForCausalLM", ("test_hf_families", "DEEPSEEK_V2"), {}),
    "deepseek_v3_yarn": ("DeepseekV3ForCausalLM", ("test_hf_families", "DEEPSEEK_V3"), {}),
}
HEADS = dict(num_attention_heads=8, num_key_value_heads=8, vocab_size=256)
MOE = ("qwen3_moe", "deepseek_v2", "deepseek_v3_yarn")


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """`hf_checkpoint(name)`: (directory, transformers' greedy tokens), written once."""
    pytest.importorskip("transformers")
    import importlib

    import torch
    from hf_reference import write_hf

    cache = {}

    def get(name):
        if name not in cache:
            cls_name, (module, base), overrides = HF_FAMILIES[name]
            tests = importlib.import_module(module)
            kwargs = {**getattr(tests, base), **HEADS, **overrides}
            ckpt = write_hf(tmp_path_factory.mktemp(name), cls_name, kwargs, seed=0)
            with torch.no_grad():
                out = ckpt.hf.generate(
                    torch.tensor([PROMPTS[0]]), do_sample=False, max_new_tokens=8, min_new_tokens=0
                )
            cache[name] = (ckpt.path, out[0, len(PROMPTS[0]) :].tolist())
        return cache[name]

    return get


# Each family on one of the two tensor meshes (taking turns), every MoE family expert-parallel
# too. (One device: test_hf_families.py.)
HF_CASES = [(n, ("1x8", "2x4")[i % 2]) for i, n in enumerate(sorted(HF_FAMILIES))]
HF_CASES += [(n, "ep") for n in MOE]


@pytest.mark.parametrize("name, mesh_name", HF_CASES)
def test_from_pretrained_on_a_mesh_gives_transformers_tokens(hf_checkpoint, name, mesh_name):
    """Every family read straight onto a 1x8 or 2x4 (and for MoE models an expert-parallel)
    mesh: each parameter where the rules put it, the greedy tokens transformers gives, under the
    attention GPUs and TPUs run by default (the paged kernel under `shard_map`)."""
    path, theirs = hf_checkpoint(name)
    mesh = sharding.make_mesh(MESHES[mesh_name])
    impl = dm.resolve_attention_impl("auto", platform="gpu")
    net = dm.from_pretrained(path, mesh=mesh, attention_impl=impl)
    assert net.cfg.attention_impl == "pallas"
    specs = _specs(net)
    assert specs == sharding.param_specs(nnx.to_pure_dict(nnx.state(net)), mesh, net.cfg)
    if mesh_name == "ep":
        moe_layer = next(k for k in specs if k.endswith("mlp/w_gate"))
        assert specs[moe_layer] == P("expert")
    else:
        assert specs["layers/1/self_attn/o_proj/kernel"] == P("tensor")
        assert specs["embed/embedding"] == P("tensor")
    assert dm.generate(net, PROMPTS[0], 8) == theirs


@pytest.mark.parametrize("name", [n for n, m in HF_CASES if m == "1x8"])
def test_the_other_families_under_the_kernel_on_2x4(hf_checkpoint, name):
    """The families the case above reads onto 1x8, on 2x4 too: every family's transformers
    tokens under the paged kernel on a data x tensor mesh."""
    path, theirs = hf_checkpoint(name)
    net = dm.from_pretrained(path, mesh=sharding.make_mesh(MESHES["2x4"]), attention_impl="pallas")
    assert dm.generate(net, PROMPTS[0], 8) == theirs


@pytest.mark.parametrize("name", sorted(MODELS))
def test_load_params_restores_each_shard_on_the_mesh(reference, name, tmp_path):
    """An orbax checkpoint of served params restored straight onto a 2x4 mesh."""
    from dualpath_jax.model.checkpoint import load_params, save_params_tree

    net, tokens = reference[name]
    save_params_tree(net, tmp_path / "ckpt")
    mesh = sharding.make_mesh(MESHES["2x4"])
    got = load_params(tmp_path / "ckpt", MODELS[name], mesh=mesh)
    specs = _specs(got)
    assert specs == sharding.param_specs(nnx.to_pure_dict(nnx.state(got)), mesh, MODELS[name])
    assert specs["layers/1/self_attn/o_proj/kernel"] == P("tensor")
    assert dm.generate(got, PROMPTS, 10) == tokens


@pytest.mark.parametrize(
    "name, kv, platform",
    [
        ("qwen2", "bf16", "cuda"),
        ("qwen2", "fp8", "tpu"),
        ("deepseek", "fp8", "cuda"),
        ("deepseek", "bf16", "tpu"),
    ],
)
def test_lowered_programs_gather_no_pages_on_a_2x4_mesh(bench_modules, name, kv, platform):
    """`bench/lower_check.py`'s programs with the accelerators' `auto` attention (the paged
    kernel under `shard_map`) lower for `cuda` and `tpu` on a data x tensor mesh and, compiled
    here, no step gathers pages; without the shard_map the decode step all-gathered the pool."""
    with bench_modules("lower_check") as (lc,):
        base = lc.model_config("tiny-qwen2", kv, platform)
        cfg = dataclasses.replace(
            MODELS[name], attention_impl=base.attention_impl, kv_dtype=base.kv_dtype,
            kv_scales=base.kv_scales, num_layers=1,
        )  # fmt: skip
        result = lc.check(cfg, platform, lc._mesh("2x4"), new=32, cached=96, slots=4, page=16)
    for prog, r in result.items():
        assert r["lowered"], (prog, r.get("error"))
        assert r["page_gathers"] == 0, (prog, r["all_gathers"])
    call = "__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
    for prog in ("prefill_layer", "decode_step"):
        assert result[prog]["kernels"] == {call: 1}
