"""Checkpoints: orbax save/restore of parameters, and Hugging Face directory import.

`from_pretrained(dir, mesh=...)` reads a Hugging Face format directory (`config.json` +
`*.safetensors`) of a supported architecture (`SUPPORTED`: Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V2
and V3) into our `Transformer`, building the model abstractly first so that no random weights
are materialised, and streaming each parameter from the memory-mapped files onto the device(s)
shard by shard (`streaming.py`). Block-wise FP8 weights (`weight_scale_inv`, as DeepSeek ships
them) travel as FP8 and are dequantized to the model dtype on the device.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import jax
import numpy as np
from flax import nnx

from dualpath_jax.config import ModelConfig, ModelFamily, from_json, to_json
from dualpath_jax.model import sharding
from dualpath_jax.model.streaming import CheckpointError, Tensors, place, stack
from dualpath_jax.model.transformer import Transformer, shard_model

# Hugging Face architectures `from_pretrained` reads, and the families they map to.
SUPPORTED = {
    "Qwen2ForCausalLM": ModelFamily.QWEN2,
    "Qwen3ForCausalLM": ModelFamily.QWEN3,
    "Qwen3MoeForCausalLM": ModelFamily.QWEN3_MOE,
    "DeepseekV2ForCausalLM": ModelFamily.DEEPSEEK_V2,
    "DeepseekV3ForCausalLM": ModelFamily.DEEPSEEK,
}
_CONFIG_NAME = "dualpath_model.json"


# --------------------------------------------------------------------------- orbax


def save_params(model: Transformer, directory: str | pathlib.Path) -> pathlib.Path:
    """Saves the model's parameters with orbax under `directory/params` and its config as JSON."""
    import orbax.checkpoint as ocp

    directory = pathlib.Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / _CONFIG_NAME).write_text(to_json(model.cfg, indent=1))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory / "params", nnx.state(model), force=True)
    return directory


def restore_params(directory: str | pathlib.Path, cfg: ModelConfig | None = None) -> Transformer:
    """Restores a model saved by `save_params` (config read from the directory unless given)."""
    import orbax.checkpoint as ocp

    directory = pathlib.Path(directory).absolute()
    if cfg is None:
        if not (directory / _CONFIG_NAME).is_file():
            raise CheckpointError(f"{directory}: no {_CONFIG_NAME}; not a saved dualpath_jax model")
        cfg = from_json(ModelConfig, (directory / _CONFIG_NAME).read_text())
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    gd, state = nnx.split(abstract)
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(directory / "params", state)
    return nnx.merge(gd, restored)


# --------------------------------------------------------------------------- Hugging Face


def config_from_hf(hf: dict[str, Any], dtype: str | None = None) -> ModelConfig:
    """Maps a Hugging Face `config.json` dict of a supported architecture to a ModelConfig.
    Raises CheckpointError for other architectures and for features the models lack (attention
    or MLP biases where the family has none, RoPE scaling other than yarn). Sliding-window
    layers map to `sliding_window` and `sliding_window_layers` (`_window_from_hf`): the KV
    layout takes them as a "last W tokens" group, the model forward refuses them
    (`model.layout.UnsupportedLayout`)."""
    archs = hf.get("architectures") or []
    family = next((SUPPORTED[a] for a in archs if a in SUPPORTED), None)
    if family is None:
        raise CheckpointError(
            f"unsupported architecture {archs or hf.get('model_type')!r}; supported: {sorted(SUPPORTED)}"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"activation {hf['hidden_act']!r} is not supported (only silu)")
    dt = dtype or {"bfloat16": "bfloat16", "float16": "float16"}.get(
        str(hf.get("dtype", hf.get("torch_dtype", "float32"))), "float32"
    )
    common = dict(
        name=hf.get("_name_or_path") or hf.get("model_type", family.value),
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 4096),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **_window_from_hf(hf, family),
        dtype=dt,
        kv_dtype=dt,
        **_rope_from_hf(hf),
    )
    if family == ModelFamily.QWEN2:
        return ModelConfig(**common, head_dim=_head_dim(hf))
    if family in (ModelFamily.QWEN3, ModelFamily.QWEN3_MOE):
        if hf.get("attention_bias"):
            raise CheckpointError("Qwen3 attention_bias=True is not supported")
        qwen3 = dict(common, head_dim=_head_dim(hf), qkv_bias=False, qk_norm=True)
        if family == ModelFamily.QWEN3:
            return ModelConfig(**qwen3)
        return ModelConfig(
            **qwen3,
            # Qwen's config.json files say num_experts, transformers 5 writes num_local_experts.
            n_routed_experts=hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"],
            num_experts_per_tok=hf["num_experts_per_tok"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            moe_layer_step=hf.get("decoder_sparse_step", 1),
            dense_layers=tuple(hf.get("mlp_only_layers") or ()),
            moe_scoring="softmax",
            topk_method="greedy",
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        )
    return ModelConfig(**common, **_deepseek_from_hf(hf, family))


def _window_from_hf(hf: dict[str, Any], family: ModelFamily) -> dict[str, Any]:
    """The `ModelConfig.sliding_window*` fields, read as transformers reads them: a window only
    with `use_sliding_window`; Qwen2 and Qwen3 window the layers `layer_types` marks
    `sliding_attention` (without `layer_types`: those from `max_window_layers` on, default 28),
    Qwen3-MoE every layer; the DeepSeek families have none."""
    if family in (ModelFamily.DEEPSEEK, ModelFamily.DEEPSEEK_V2):
        return {}
    n = hf["num_hidden_layers"]
    window = int(hf.get("sliding_window") or 0) if hf.get("use_sliding_window") else 0
    types = hf.get("layer_types")
    if family == ModelFamily.QWEN3_MOE:
        layers = tuple(range(n)) if window else ()
    elif types is not None:
        if len(types) != n or set(types) - {"full_attention", "sliding_attention"}:
            raise CheckpointError(
                f"layer_types {types!r}: expected {n} of full_attention / sliding_attention"
            )
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        if layers and not window:
            raise CheckpointError(
                f"layer_types marks sliding-window layers {list(layers)}, but the config sets"
                " no window (use_sliding_window and sliding_window)"
            )
    else:
        layers = tuple(range(hf.get("max_window_layers", 28), n)) if window else ()
    return dict(sliding_window=window if layers else 0, sliding_window_layers=layers)


def _head_dim(hf: dict[str, Any]) -> int:
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def _rope_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """The `ModelConfig.rope_*` fields of a Hugging Face config (`rope_parameters`, or the older
    `rope_scaling` with a top-level `rope_theta`), defaults filled in as transformers does."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in rope.values()):
        raise CheckpointError("RoPE parameters per layer type are not supported")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor")) or 1.0
    if partial != 1.0:
        raise CheckpointError(f"partial rotary embeddings ({partial}) are not supported")
    if rope_type == "default":
        return dict(rope_theta=theta)
    if rope_type != "yarn":
        raise CheckpointError(
            f"RoPE scaling {rope_type!r} is not supported (supported: default, yarn)"
        )
    # transformers takes a top-level original_max_position_embeddings over the RoPE dict's.
    original = (
        hf.get("original_max_position_embeddings")
        or rope.get("original_max_position_embeddings")
        or hf.get("max_position_embeddings", 4096)
    )
    factor = rope.get("factor") or hf.get("max_position_embeddings", 4096) / original
    return dict(
        rope_theta=theta,
        rope_type="yarn",
        rope_factor=float(factor),
        rope_original_max_len=int(original),
        rope_beta_fast=float(rope.get("beta_fast") or 32.0),
        rope_beta_slow=float(rope.get("beta_slow") or 1.0),
        rope_mscale=float(rope.get("mscale") or 0.0),
        rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
        rope_attention_factor=float(rope.get("attention_factor") or 0.0),
        rope_truncate=bool(rope.get("truncate", True)),
    )


def _deepseek_from_hf(hf: dict[str, Any], family: ModelFamily) -> dict[str, Any]:
    """The MLA and MoE fields of a DeepSeek-V2 or V3 config."""
    if hf.get("attention_bias"):
        raise CheckpointError("DeepSeek attention_bias=True is not supported")
    if hf.get("mlp_bias"):
        raise CheckpointError("DeepSeek mlp_bias=True is not supported")
    if hf.get("moe_layer_freq", 1) != 1:
        raise CheckpointError(f"DeepSeek moe_layer_freq={hf['moe_layer_freq']} is not supported")
    if family == ModelFamily.DEEPSEEK_V2:
        # transformers' DeepseekV2 never normalizes the chosen weights, DeepSeek's own code does
        # when norm_topk_prob is set; the published V2 configs leave it false, where both agree.
        if hf.get("norm_topk_prob"):
            raise CheckpointError(
                "DeepSeek-V2 norm_topk_prob=True is not supported (transformers ignores it)"
            )
        routing = dict(
            moe_scoring="softmax",
            topk_method=hf.get("topk_method") or "greedy",
            norm_topk_prob=False,
        )
        scoring = hf.get("scoring_func", "softmax")
    else:
        routing = dict(
            moe_scoring="sigmoid",
            topk_method=hf.get("topk_method") or "noaux_tc",
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        )
        scoring = hf.get("scoring_func", "sigmoid")
    if scoring != routing["moe_scoring"]:
        raise CheckpointError(f"{family.value} scoring_func {scoring!r} is not supported")
    allowed = (
        ("greedy", "group_limited_greedy") if family == ModelFamily.DEEPSEEK_V2 else ("noaux_tc",)
    )
    if routing["topk_method"] not in allowed:
        raise CheckpointError(
            f"{family.value} topk_method {routing['topk_method']!r} is not supported"
            f" (supported: {', '.join(allowed)})"
        )
    return dict(
        head_dim=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"],
        qkv_bias=False,
        q_lora_rank=hf.get("q_lora_rank") or 0,
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        # DeepSeek-V2 always rotates interleaved pairs (transformers' V2 has no such option).
        rope_interleave=family == ModelFamily.DEEPSEEK_V2 or bool(hf.get("rope_interleave", True)),
        n_routed_experts=hf["n_routed_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        n_shared_experts=hf.get("n_shared_experts") or 0,
        moe_intermediate_size=hf["moe_intermediate_size"],
        first_k_dense_replace=hf.get("first_k_dense_replace") or 0,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        n_group=hf.get("n_group") or 1,
        topk_group=hf.get("topk_group") or 1,
        **routing,
    )


def _hf_layer(cfg: ModelConfig, t: Tensors, i: int) -> dict[str, Any]:
    """Our parameter dict of layer i from HF tensors (torch Linear weights are `[out, in]`)."""
    p = f"model.layers.{i}."
    lin = lambda name: t.get(p + name + ".weight").T  # noqa: E731
    out: dict[str, Any] = {
        "input_layernorm": {"weight": t.get(p + "input_layernorm.weight")},
        "post_attention_layernorm": {"weight": t.get(p + "post_attention_layernorm.weight")},
    }
    if not cfg.is_mla:
        attn = {
            n: {"kernel": lin(f"self_attn.{n}")} for n in ("q_proj", "k_proj", "v_proj", "o_proj")
        }
        if cfg.qkv_bias:
            for n in ("q_proj", "k_proj", "v_proj"):
                attn[n]["bias"] = t.get(p + f"self_attn.{n}.bias")
        if cfg.qk_norm:
            for n in ("q_norm", "k_norm"):
                attn[n] = {"weight": t.get(p + f"self_attn.{n}.weight", (cfg.head_dim,))}
    else:
        attn = {
            "kv_a_proj_with_mqa": {"kernel": lin("self_attn.kv_a_proj_with_mqa")},
            "kv_a_layernorm": {"weight": t.get(p + "self_attn.kv_a_layernorm.weight")},
            "o_proj": {"kernel": lin("self_attn.o_proj")},
        }
        if cfg.q_lora_rank:
            attn["q_a_proj"] = {"kernel": lin("self_attn.q_a_proj")}
            attn["q_a_layernorm"] = {"weight": t.get(p + "self_attn.q_a_layernorm.weight")}
            attn["q_b_proj"] = {"kernel": lin("self_attn.q_b_proj")}
        else:
            attn["q_proj"] = {"kernel": lin("self_attn.q_proj")}
        kvb = np.asarray(  # [H * (dn + dv), r] (FP8 dequantized: it is split per head)
            t.get(
                p + "self_attn.kv_b_proj.weight",
                (cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
            )
        )
        kvb = kvb.reshape(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        attn["w_uk"] = kvb[:, : cfg.qk_nope_head_dim].transpose(2, 0, 1)
        attn["w_uv"] = kvb[:, cfg.qk_nope_head_dim :].transpose(2, 0, 1)
    out["self_attn"] = attn
    if cfg.is_moe_layer(i):
        mlp: dict[str, Any] = {"router": t.get(p + "mlp.gate.weight").astype(np.float32)}
        if cfg.topk_method == "noaux_tc":
            mlp["e_score_correction_bias"] = (
                t.get(p + "mlp.gate.e_score_correction_bias").astype(np.float32)
                if t.has(p + "mlp.gate.e_score_correction_bias")
                else np.zeros(cfg.n_routed_experts, np.float32)
            )
        e, h, mi = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        if t.has(p + "mlp.experts.gate_up_proj"):  # fused layout [E, 2I, H], [E, H, I]
            gu = t.get(p + "mlp.experts.gate_up_proj", (e, 2 * mi, h))
            mlp["w_gate"] = gu[:, :mi].transpose(0, 2, 1)
            mlp["w_up"] = gu[:, mi:].transpose(0, 2, 1)
            mlp["w_down"] = t.get(p + "mlp.experts.down_proj", (e, h, mi)).transpose(0, 2, 1)
        else:
            shapes = {"gate_proj": (mi, h), "up_proj": (mi, h), "down_proj": (h, mi)}
            for ours, theirs in (
                ("w_gate", "gate_proj"),
                ("w_up", "up_proj"),
                ("w_down", "down_proj"),
            ):
                mlp[ours] = stack(
                    [
                        t.get(p + f"mlp.experts.{j}.{theirs}.weight", shapes[theirs]).T
                        for j in range(e)
                    ]
                )
        if cfg.n_shared_experts:
            mlp["shared"] = {
                n: {"kernel": lin(f"mlp.shared_experts.{n}")}
                for n in ("gate_proj", "up_proj", "down_proj")
            }
    else:
        mlp = {n: {"kernel": lin(f"mlp.{n}")} for n in ("gate_proj", "up_proj", "down_proj")}
    out["mlp"] = mlp
    return out


def from_pretrained(
    directory: str | pathlib.Path,
    dtype: str | None = None,
    *,
    mesh: jax.sharding.Mesh | None = None,
    attention_impl: str = "auto",
    moe_impl: str = "auto",
) -> Transformer:
    """Loads a Hugging Face format directory (`config.json` + `*.safetensors`) of a supported
    architecture (`SUPPORTED`), streaming: the files are memory-mapped and each parameter is
    placed shard by shard (`streaming.place`), so host memory holds about one tensor at a time,
    never the model; block-wise FP8 weights travel as FP8 and are dequantized on the device.
    With `mesh` every parameter lands split over it by the partition rules
    (`sharding.param_shardings`). `dtype`: the parameter dtype (default: the checkpoint's);
    `attention_impl` / `moe_impl`: the backends (`ModelConfig.attention_impl`,
    `ModelConfig.moe_impl`)."""
    directory = pathlib.Path(directory)
    if not (directory / "config.json").is_file():
        raise CheckpointError(f"{directory}: no config.json")
    hf = json.loads((directory / "config.json").read_text())
    cfg = dataclasses.replace(
        config_from_hf(hf, dtype), attention_impl=attention_impl, moe_impl=moe_impl
    )
    block = (hf.get("quantization_config") or {}).get("weight_block_size") or (128, 128)
    gd, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    shapes = nnx.to_pure_dict(state)
    if mesh is not None:
        shardings = sharding.param_shardings(shapes, mesh, cfg)
    else:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: one, shapes)
    with Tensors(directory, tuple(block)) as t:

        def load(key, values):
            return _place_like(values, shapes[key], shardings[key], f"/{key}", t)

        head = {"norm": {"weight": t.get("model.norm.weight")}}
        if not cfg.tie_embeddings:
            head["lm_head"] = {"kernel": t.get("lm_head.weight").T}
        pure: dict[str, Any] = {
            "embed": load("embed", {"embedding": t.get("model.embed_tokens.weight")}),
            "head": load("head", head),
            "layers": {},
        }
        for i in range(cfg.num_layers):  # one layer's views at a time
            layer = _hf_layer(cfg, t, i)
            pure["layers"][i] = _place_like(
                layer, shapes["layers"][i], shardings["layers"][i], f"/layers/{i}", t
            )
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(gd, state)


def _place_like(values: Any, shapes: Any, shardings: Any, path: str, t: Tensors) -> Any:
    """Checks every tensor against the model's expected shape and places it on the device(s)
    in the parameter dtype (`streaming.place`), releasing the file pages after each."""
    if isinstance(shapes, dict):
        if not isinstance(values, dict) or set(values) != set(shapes):
            missing = set(shapes) - set(values if isinstance(values, dict) else {})
            raise CheckpointError(
                f"parameters at {path or '/'} do not match the model: missing {missing}"
            )
        return {
            k: _place_like(values[k], shapes[k], shardings[k], f"{path}/{k}", t) for k in shapes
        }
    if tuple(values.shape) != tuple(shapes.shape):
        raise CheckpointError(
            f"tensor {path}: shape {tuple(values.shape)}, model expects {tuple(shapes.shape)}"
        )
    out = place(values, shardings, shapes.dtype)
    t.release(values)
    return out


# --------------------------------------------------------------------------- served parameters


def params_state(params: Any) -> Any:
    """The pure nested dict of arrays of `params`: a `Transformer`, its `nnx.State`, or a nested
    dict of arrays (`nnx.to_pure_dict` layout: `embed`, `head`, `layers/<i>/...`)."""
    if isinstance(params, nnx.Module):
        params = nnx.state(params)
    if isinstance(params, nnx.State):
        return nnx.to_pure_dict(params)
    if isinstance(params, dict):
        return params
    raise CheckpointError(
        f"parameters must be a Transformer, an nnx.State or a nested dict, got {type(params).__name__}"
    )


def save_params_tree(
    params: Any, directory: str | pathlib.Path, cfg: ModelConfig | None = None
) -> pathlib.Path:
    """Saves `params` (see `params_state`) as an orbax checkpoint in `directory/params`, in the
    pure-dict layout, plus the model config when known. Nothing is checked here: the engines
    check the tree against their model when they load it (`load_params`)."""
    import orbax.checkpoint as ocp

    directory = pathlib.Path(directory).absolute()
    tree = params_state(params)
    if cfg is None and isinstance(params, Transformer):
        cfg = params.cfg
    directory.mkdir(parents=True, exist_ok=True)
    if cfg is not None:
        (directory / _CONFIG_NAME).write_text(to_json(cfg, indent=1))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(directory / "params", jax.tree.map(np.asarray, tree), force=True)
    return directory


def _flat_spec(tree: Any, strip_value: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """`path -> (shape, dtype)` of every leaf; `strip_value` drops nnx.State's trailing `value`."""
    out = {}
    for kp, leaf in jax.tree_util.tree_leaves_with_path(tree):
        parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in kp]
        if strip_value and parts and parts[-1] == "value":
            parts = parts[:-1]
        dtype = leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype
        out["/".join(parts)] = (tuple(np.shape(leaf)), str(np.dtype(dtype)))
    return out


def _leaves(n: int) -> str:
    return f"{n} leaf" if n == 1 else f"{n} leaves"


def check_params_tree(expected: dict, got: dict, where: str = "") -> None:
    """Raises CheckpointError naming every missing/unexpected leaf and shape/dtype mismatch
    (at most 8 of each) between two `path -> (shape, dtype)` maps."""
    problems = []
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing:
        problems.append(f"missing {_leaves(len(missing))}, e.g. {missing[:8]}")
    if extra:
        problems.append(f"unexpected {_leaves(len(extra))}, e.g. {extra[:8]}")
    bad = [
        f"{p}: {got[p][1]}{list(got[p][0])} but the model has {expected[p][1]}{list(expected[p][0])}"
        for p in sorted(set(expected) & set(got))
        if got[p] != expected[p]
    ]
    if bad:
        problems.append(
            f"{_leaves(len(bad))} {'differs' if len(bad) == 1 else 'differ'}: " + "; ".join(bad[:8])
        )
    if problems:
        raise CheckpointError(f"{where}parameters do not match the model: " + " | ".join(problems))


def load_params(
    directory: str | pathlib.Path, cfg: ModelConfig, *, mesh: jax.sharding.Mesh | None = None
) -> Transformer:
    """Loads served parameters for a model of config `cfg`, checking them first; with `mesh`,
    each parameter lands split over it by the partition rules (a Hugging Face directory streams
    shard by shard, an orbax checkpoint in the pure-dict layout restores each shard in place).

    `directory` is an orbax checkpoint written by `save_params_tree` or `save_params` (a
    `params/` subdirectory, either tree layout) or a Hugging Face directory (`config.json` +
    safetensors, through `from_pretrained`). Raises CheckpointError, naming what differs, when
    the directory is missing, was saved for another model config, or holds a tree whose
    structure, shapes or dtypes differ from the model's; nothing is half-loaded.
    """
    import orbax.checkpoint as ocp

    directory = pathlib.Path(directory).absolute()
    if not directory.is_dir():
        raise CheckpointError(
            f"parameter checkpoint {directory} does not exist or is not a directory"
        )
    if not (directory / "params").is_dir():
        if (directory / "config.json").is_file():
            model = from_pretrained(directory, cfg.dtype, mesh=mesh)
            if model.cfg != cfg:
                raise CheckpointError(
                    f"{directory}: the Hugging Face config does not match the served model config"
                )
            return model
        raise CheckpointError(f"{directory}: no params/ (orbax) and no config.json (Hugging Face)")
    saved_cfg = directory / _CONFIG_NAME
    if saved_cfg.is_file():
        other = from_json(ModelConfig, saved_cfg.read_text())
        if other != cfg:
            diff = sorted(
                f.name
                for f in dataclasses.fields(cfg)
                if getattr(cfg, f.name) != getattr(other, f.name)
            )
            raise CheckpointError(
                f"{directory} was saved for another model config (differs in {diff})"
            )
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    gd, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)
    with ocp.StandardCheckpointer() as ckptr:
        try:
            meta = ckptr.metadata(directory / "params")
        except Exception as e:  # noqa: BLE001 - orbax raises many kinds for unreadable dirs
            raise CheckpointError(
                f"{directory}/params is not a readable orbax checkpoint: {e}"
            ) from None
        tree = getattr(meta, "item_metadata", meta)
        state_layout = any(p.endswith("/value") for p in _flat_spec(tree, False))
        check_params_tree(_flat_spec(pure, False), _flat_spec(tree, state_layout), f"{directory}: ")
        if state_layout:  # `save_params`' layout: restored whole, then placed
            model = nnx.merge(gd, ckptr.restore(directory / "params", state))
            return model if mesh is None else shard_model(model, mesh)
        if mesh is not None:
            where = sharding.param_shardings(pure, mesh, cfg)
            target = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), pure, where
            )
        else:
            target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), pure)
        restored = ckptr.restore(directory / "params", target)
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(gd, state)


def model_from_params(params: Any, cfg: ModelConfig) -> Transformer:
    """A `Transformer` of config `cfg` holding `params` (see `params_state`), checked first:
    CheckpointError names every leaf whose path, shape or dtype differs from the model's."""
    if isinstance(params, Transformer) and params.cfg != cfg:
        raise CheckpointError("the new model has a different config")
    tree = params_state(params)
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    gd, state = nnx.split(abstract)
    check_params_tree(_flat_spec(nnx.to_pure_dict(state), False), _flat_spec(tree, False))
    nnx.replace_by_pure_dict(state, jax.tree.map(jax.numpy.asarray, tree))
    return nnx.merge(gd, state)
