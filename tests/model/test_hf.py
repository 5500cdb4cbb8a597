"""`from_pretrained` of checkpoints written by transformers matches transformers' own forward.

Each checkpoint is a tiny random Qwen2 or DeepSeek-V3 built here, re-initialised with weights
large enough that logits are well separated (transformers' std 0.02 init makes them nearly flat,
which would hide errors and make greedy ties likely), saved with `save_pretrained`, and compared
against the same torch model: logits to 1e-4 relative, greedy tokens exactly. Derived directories
rewrite the safetensors with numpy: the fused expert layout and block-wise FP8 weights.
"""

from __future__ import annotations

import copy
import json
import pathlib
import re
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import ml_dtypes  # noqa: E402
import safetensors.torch  # noqa: E402
from flax import nnx  # noqa: E402
from hf_reference import (  # noqa: E402
    NEW_TOKENS,
    NO_SPECIAL_TOKENS,
    PROMPT,
    RTOL,
    Checkpoint,
    hf_logits,
    our_logits,
    rel_err,
    write_hf,
)
from safetensors.numpy import load_file, save_file  # noqa: E402
from tiers import family_params  # noqa: E402

from dualpath_jax.config import ModelFamily  # noqa: E402
from dualpath_jax.model.checkpoint import CheckpointError, from_pretrained  # noqa: E402
from dualpath_jax.model.generation import generate  # noqa: E402
from dualpath_jax.model.runner import ModelRunner  # noqa: E402

pytestmark = pytest.mark.hf

FP8_BLOCK = 128

QWEN2 = dict(
    vocab_size=257,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    tie_word_embeddings=False,
    **NO_SPECIAL_TOKENS,
)
DEEPSEEK = dict(
    vocab_size=257,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    **NO_SPECIAL_TOKENS,
)


def _rewrite(base: Checkpoint, path: pathlib.Path, edit) -> pathlib.Path:
    """Copies `base`'s config into `path` with its tensors rewritten as `edit(tensors)`."""
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(base.path.glob("*.safetensors")):
        tensors.update(load_file(f))
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(base.path / "config.json", path / "config.json")
    save_file(edit(tensors), path / "model.safetensors")
    return path


def _fuse_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-expert `experts.{e}.{gate,up,down}_proj.weight` -> fused `experts.gate_up_proj`
    `[E, 2I, H]` and `experts.down_proj` `[E, H, I]`."""
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    layers = sorted({k.split(".mlp.experts.")[0] for k in tensors if ".mlp.experts." in k})
    for p in layers:
        e = range(DEEPSEEK["n_routed_experts"])
        w = lambda i, n: tensors[f"{p}.mlp.experts.{i}.{n}.weight"]  # noqa: E731
        out[f"{p}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([w(i, "gate_proj"), w(i, "up_proj")]) for i in e]
        )
        out[f"{p}.mlp.experts.down_proj"] = np.stack([w(i, "down_proj") for i in e])
    return out


def quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Block-wise FP8 as DeepSeek ships it: w `[out, in]` -> (float8_e4m3fn weight, float32
    `scale_inv` `[ceil(out/128), ceil(in/128)]`, the float32 weight they dequantize to)."""
    out_dim, in_dim = w.shape
    so, si = -(-out_dim // FP8_BLOCK), -(-in_dim // FP8_BLOCK)
    q = np.empty(w.shape, ml_dtypes.float8_e4m3fn)
    deq = np.empty(w.shape, np.float32)
    scale = np.empty((so, si), np.float32)
    for i in range(so):
        for j in range(si):
            blk = (
                slice(i * FP8_BLOCK, (i + 1) * FP8_BLOCK),
                slice(j * FP8_BLOCK, (j + 1) * FP8_BLOCK),
            )
            # Blocks' scales differ by powers of two, so a wrong block mapping is visible.
            scale[i, j] = np.float32(np.abs(w[blk]).max() / 448.0 * 2.0 ** (i + j))
            q[blk] = (w[blk] / scale[i, j]).astype(ml_dtypes.float8_e4m3fn)
            deq[blk] = q[blk].astype(np.float32) * scale[i, j]
    return q, scale, deq


def _fp8_variant(base: Checkpoint, path: pathlib.Path, quantize) -> Checkpoint:
    """`base` with every weight named by `quantize(name)` stored as block-wise FP8; the reference
    model holds the dequantized weights."""
    dequantized: dict[str, np.ndarray] = {}

    def edit(tensors):
        out = dict(tensors)
        for name, w in tensors.items():
            if quantize(name):
                out[name], out[name + "_scale_inv"], dequantized[name] = quantize_fp8(w)
        return out

    _rewrite(base, path, edit)
    hf = copy.deepcopy(base.hf)
    for name, w in dequantized.items():
        _set_hf_weight(hf, name, w)
    return Checkpoint(path, hf)


def _set_hf_weight(model: torch.nn.Module, name: str, w: np.ndarray) -> None:
    """Sets the weight a checkpoint stores as `name`; in memory, transformers fuses the experts."""
    params = dict(model.named_parameters())
    expert = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
    with torch.no_grad():
        if expert is None:
            params[name].copy_(torch.from_numpy(w))
            return
        prefix, e, kind = expert[1], int(expert[2]), expert[3]
        mi = w.shape[1] if kind == "down" else w.shape[0]
        target = {
            "gate": params[f"{prefix}.gate_up_proj"][e, :mi],
            "up": params[f"{prefix}.gate_up_proj"][e, mi:],
            "down": params[f"{prefix}.down_proj"][e],
        }[kind]
        target.copy_(torch.from_numpy(w))


def _is_projection(name: str) -> bool:
    return name.endswith("_proj.weight") or name == "lm_head.weight"


_BUILDERS = {
    "qwen2": lambda d, get: write_hf(d, "Qwen2ForCausalLM", QWEN2, 0),
    "qwen2_tied": lambda d, get: write_hf(
        d, "Qwen2ForCausalLM", {**QWEN2, "num_hidden_layers": 2, "tie_word_embeddings": True}, 1
    ),
    # intermediate 288 = 2 * 128 + 32: FP8 blocks are partial along both axes of the MLP weights.
    "qwen2_wide": lambda d, get: write_hf(
        d, "Qwen2ForCausalLM", {**QWEN2, "num_hidden_layers": 2, "intermediate_size": 288}, 2
    ),
    "deepseek": lambda d, get: write_hf(d, "DeepseekV3ForCausalLM", DEEPSEEK, 3),
    "deepseek_no_q_lora": lambda d, get: write_hf(
        d, "DeepseekV3ForCausalLM", {**DEEPSEEK, "q_lora_rank": None}, 4
    ),
    "deepseek_fused": lambda d, get: Checkpoint(
        _rewrite(get("deepseek"), d, _fuse_experts), get("deepseek").hf
    ),
    "qwen2_wide_fp8": lambda d, get: _fp8_variant(get("qwen2_wide"), d, _is_projection),
    "deepseek_fp8": lambda d, get: _fp8_variant(get("deepseek"), d, _is_projection),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """`checkpoint(name)`: the named checkpoint, written once per module."""
    cache: dict[str, Checkpoint] = {}

    def get(name: str) -> Checkpoint:
        if name not in cache:
            cache[name] = _BUILDERS[name](tmp_path_factory.mktemp(name), get)
        return cache[name]

    return get


def pure_params(model) -> dict:
    """{path tuple: array} of every parameter and buffer."""
    return nnx.traversals.flatten_mapping(nnx.to_pure_dict(nnx.state(model)))


ALL = [
    "qwen2",
    "qwen2_tied",
    "deepseek",
    "deepseek_no_q_lora",
    "deepseek_fused",
    "qwen2_wide_fp8",
    "deepseek_fp8",
]
GENERATE = ["qwen2", "qwen2_tied", "deepseek", "deepseek_no_q_lora"]


@pytest.mark.parametrize("name", ALL)
def test_logits_match_transformers(checkpoint, name):
    ckpt = checkpoint(name)
    theirs = hf_logits(ckpt.hf, PROMPT)
    # Well-separated logits, or the comparison would say little.
    assert np.abs(theirs).max() > 1.0 and theirs[-1].std() > 0.3
    err = rel_err(our_logits(ModelRunner(from_pretrained(ckpt.path)), PROMPT), theirs)
    assert err < RTOL, f"{name}: max relative logit error {err:.2e}"


@pytest.mark.parametrize(
    "impl, moe_impl",
    # The oracle backend in the fast tier; the others (compiles of their own) in the full one.
    [("reference", "ragged_dot")]
    + [
        pytest.param(*i, marks=pytest.mark.slow)
        for i in [("xla", "grouped"), ("xla", "gmm"), ("pallas", "ragged_dot")]
    ],
)
@pytest.mark.parametrize(
    "name",
    # the variants' logits are compared in the fast tier; their greedy runs in the full one
    family_params(GENERATE),
)
def test_greedy_tokens_match_transformers(checkpoint, name, impl, moe_impl):
    ckpt = checkpoint(name)
    with torch.no_grad():
        out = ckpt.hf.generate(
            torch.tensor([PROMPT]), do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=0
        )
    theirs = out[0, len(PROMPT) :].tolist()
    assert len(theirs) == NEW_TOKENS
    model = from_pretrained(ckpt.path, attention_impl=impl, moe_impl=moe_impl)
    assert (model.cfg.attention_impl, model.cfg.moe_impl) == (impl, moe_impl)
    ours = generate(ModelRunner(model), [PROMPT], NEW_TOKENS)[0]
    assert ours == theirs


@pytest.mark.parametrize(
    "name, expect",
    [
        (
            "qwen2",
            dict(
                family=ModelFamily.QWEN2,
                num_kv_heads=2,
                head_dim=16,
                rope_theta=5e4,
                max_seq_len=512,
            ),
        ),
        ("qwen2_tied", dict(tie_embeddings=True, num_layers=2)),
        (
            "deepseek",
            dict(
                family=ModelFamily.DEEPSEEK, q_lora_rank=24, head_dim=24, routed_scaling_factor=2.5
            ),
        ),
        (
            "deepseek_no_q_lora",
            dict(q_lora_rank=0, kv_lora_rank=32, first_k_dense_replace=1, n_group=2),
        ),
    ],
)
def test_config_from_transformers_config(checkpoint, name, expect):
    cfg = from_pretrained(checkpoint(name).path).cfg
    assert {k: getattr(cfg, k) for k in expect} == expect


def test_fused_expert_layout_loads_the_same_parameters(checkpoint):
    per_expert = pure_params(from_pretrained(checkpoint("deepseek").path))
    fused = pure_params(from_pretrained(checkpoint("deepseek_fused").path))
    assert per_expert.keys() == fused.keys()
    for k in per_expert:
        np.testing.assert_array_equal(
            np.asarray(per_expert[k]), np.asarray(fused[k]), err_msg=str(k)
        )


def _load_with_fp8(path: pathlib.Path) -> dict[str, np.ndarray]:
    """safetensors' numpy reader knows no float8 dtype, so read through torch."""
    out = {}
    for k, v in safetensors.torch.load_file(path).items():
        fp8 = v.dtype == torch.float8_e4m3fn
        out[k] = v.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn) if fp8 else v.numpy()
    return out


def test_fp8_weights_are_dequantized_blockwise(checkpoint):
    model = from_pretrained(checkpoint("qwen2_wide_fp8").path)
    files = _load_with_fp8(checkpoint("qwen2_wide_fp8").path / "model.safetensors")
    for name, kernel in [
        ("lm_head.weight", model.head.lm_head.kernel),  # [257, 64]: 3 x 1 blocks, last one partial
        ("model.layers.1.mlp.up_proj.weight", model.layers[1].mlp.up_proj.kernel),  # [288, 64]
        ("model.layers.0.mlp.down_proj.weight", model.layers[0].mlp.down_proj.kernel),  # [64, 288]
    ]:
        q, scale = files[name], files[name + "_scale_inv"]
        assert q.dtype == ml_dtypes.float8_e4m3fn
        assert scale.shape == tuple(-(-d // FP8_BLOCK) for d in q.shape)
        per_element = np.kron(scale, np.ones((FP8_BLOCK, FP8_BLOCK), np.float32))
        want = q.astype(np.float32) * per_element[: q.shape[0], : q.shape[1]]
        np.testing.assert_array_equal(np.asarray(kernel[...]).T, want, err_msg=name)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "base, name, shape, named",
    [
        # Linear weights are checked after conversion, so the message uses our parameter path.
        (
            "qwen2",
            "model.layers.1.self_attn.q_proj.weight",
            (64, 70),
            "/layers/1/self_attn/q_proj/kernel",
        ),
        ("qwen2", "model.embed_tokens.weight", (256, 64), "/embed/embedding"),
        # Tensors reshaped or stacked on load are checked before, under their checkpoint name.
        ("deepseek", "model.layers.0.self_attn.kv_b_proj.weight", (120, 32), None),
        ("deepseek", "model.layers.2.mlp.experts.3.up_proj.weight", (32, 48), None),
        ("deepseek_fused", "model.layers.1.mlp.experts.gate_up_proj", (8, 60, 64), None),
    ],
)
def test_wrong_tensor_shape_is_named(checkpoint, tmp_path, base, name, shape, named):
    rs = np.random.RandomState(0)
    bad = rs.standard_normal(shape).astype(np.float32)
    path = _rewrite(checkpoint(base), tmp_path, lambda t: t | {name: bad})
    with pytest.raises(CheckpointError, match=re.escape(named or name)):
        from_pretrained(path)


def test_missing_tensor_is_named(checkpoint, tmp_path):
    name = "model.layers.1.mlp.gate_proj.weight"
    path = _rewrite(
        checkpoint("qwen2"), tmp_path, lambda t: {k: v for k, v in t.items() if k != name}
    )
    with pytest.raises(CheckpointError, match=name):
        from_pretrained(path)


def test_unsupported_architecture_in_transformers_config(checkpoint, tmp_path):
    path = _rewrite(checkpoint("qwen2"), tmp_path, lambda t: t)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="LlamaForCausalLM"):
        from_pretrained(path)
