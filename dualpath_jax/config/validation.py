"""`validate(cfg)`: every field of an `ExperimentConfig` checked for its type, its range or set of
values, and its relations to other fields; the first wrong key raises `ConfigError` naming it."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import typing
from typing import Any

from dualpath_jax.config.schema import ConfigError, ExperimentConfig
from dualpath_jax.config.specs import (
    ROLES,
    endpoint_problem,
    mesh_problem,
    mesh_size,
    resources_problem,
)

# Bounds of the numeric fields: (rule, test, keys). A numeric field not named here must be >= 0
# (where 0 has a meaning, it is documented at the field: unlimited, derived, unbounded, off).
# NaN and infinities are rejected everywhere (no field means anything by them).
_BOUNDS: tuple[tuple[str, typing.Callable[[float], bool], str], ...] = (
    (
        "must be >= 1",
        lambda v: v >= 1,
        "model.vocab_size model.hidden_size model.num_layers model.num_heads model.num_kv_heads"
        " model.head_dim model.intermediate_size model.max_seq_len model.n_group model.topk_group"
        " model.moe_layer_step"
        " hardware.engines_per_node"
        " cluster.prefill_nodes cluster.decode_nodes cluster.pe_group_size cluster.de_group_size"
        " cluster.decode_slots cluster.decode_max_len cluster.decode_steps cluster.max_attempts cluster.decode_processes"
        " cluster.prefill_processes"
        " scheduler.max_queue store.block_tokens store.io_concurrency"
        " workload.trajectories workload.trace_block_tokens",
    ),
    (
        "must be > 0",
        lambda v: v > 0,
        "model.rope_theta hardware.dram_buffer_bytes hardware.high_weight hardware.low_weight"
        " cluster.heartbeat_s cluster.heartbeat_timeout_s cluster.no_engine_timeout_s"
        " cluster.fetch_interval_s cluster.transfer_timeout_s cluster.params_load_timeout_s"
        " cluster.params_retry_s"
        " cluster.prefill_start_timeout_s"
        " scheduler.alpha_s scheduler.beta_s scheduler.compute_quota_ms scheduler.z_factor"
        " scheduler.prefetch_hold_factor"
        " store.timeout_s workload.length_scale workload.ttft_slo_s workload.tpot_slo_s"
        " workload.trace_bytes_per_token",
    ),
    ("must lie in [0, 65535]", lambda v: 0 <= v <= 65535, "cluster.router_port"),
    ("must be >= -1 (-1: unlimited)", lambda v: v >= -1, "store.capacity_bytes"),
    ("must lie in (0, 1]", lambda v: 0 < v <= 1, "store.capacity_fraction"),
    (
        "must lie in [0, 1]",
        lambda v: 0 <= v <= 1,
        "cluster.decode_kv_fraction cluster.device_memory_fraction",
    ),
    ("must lie in [0, 2**63)", lambda v: 0 <= v < 2**63, "seed workload.seed"),
)
_BOUND_OF = {key: (rule, ok) for rule, ok, keys in _BOUNDS for key in keys.split()}
_DEFAULT_BOUND = ("must be >= 0", lambda v: v >= 0)

# Trace formats whose files carry arrival times (workload.formats.TIMED_FORMATS).
TIMED_FORMATS = ("mooncake", "weka", "tracelab")

# String fields with a fixed set of values (the enum-typed fields are checked by their type).
_CHOICES = {
    "model.attention_impl": ("auto", "reference", "xla", "pallas"),  # layers.ATTENTION_IMPLS
    "model.moe_impl": ("auto", "ragged_dot", "grouped", "gmm"),  # model.moe.MOE_IMPLS
    "model.rope_type": ("default", "yarn"),
    "model.moe_scoring": ("sigmoid", "softmax"),
    "model.topk_method": ("greedy", "group_limited_greedy", "noaux_tc"),
    "store.kind": ("file", "memory", "spec"),
    "store.eviction": ("lru", "retention"),  # kvstore.index.POLICIES
    "cluster.host_buffer_memory": ("pinned_host", "pageable"),  # kvstore.buffers.MEMORIES
    "cluster.platform": ("", "cpu", "gpu", "tpu"),  # engine.devices.PLATFORMS
    "workload.mode": ("offline", "online"),
    "ray.strategy": ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
    "ray.span_strategy": ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
    "scheduler.recompute": ("never", "auto", "always"),
    "hardware.calibration": ("hopper", "none"),  # presets.CALIBRATIONS
    "hardware.kv_format": (
        "",
        "fp8_flashmla",
        "float32",
        "bfloat16",
        "float16",
        "float8_e4m3fn",
        "float8_e5m2",
    ),
    # workload.formats.FORMATS
    "workload.trace_format": ("jsonl", "mooncake", "conversation", "weka", "tracelab"),
}


def _cost_json_problem(text: str) -> str:
    """Why `text` is not a `FittedCostModel` JSON (`sched.cost`; empty: it is one)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        return f"is not JSON ({e})"
    if not isinstance(data, dict) or "prefill" not in data:
        return 'must be a JSON object with "prefill": [p0, p1, p2] (FittedCostModel.to_json)'
    for part in ("prefill", "decode"):
        v = data.get(part, [0, 0, 0])
        numbers = isinstance(v, list) and all(
            isinstance(x, int | float) and not isinstance(x, bool) for x in v
        )
        if not numbers or len(v) != 3 or not all(math.isfinite(x) and x >= 0 for x in v):
            return f'"{part}" must be 3 finite numbers >= 0 (seconds)'
    return ""


def _relations(c: ExperimentConfig) -> list[tuple[str, bool, str]]:
    """(key, holds, rule) of the rules that relate fields to each other."""
    m, cl, w, hw = c.model, c.cluster, c.workload, c.hardware
    moe = m.n_routed_experts > 0
    yarn = m.rope_type == "yarn"
    grouped = moe and m.topk_method != "greedy" and m.n_routed_experts % m.n_group == 0
    group_experts = m.topk_group * (m.n_routed_experts // m.n_group)
    dense = m.dense_layers
    cost_problem = _cost_json_problem(cl.prefill_cost_json) if cl.prefill_cost_json else ""
    mesh_problems = {role: mesh_problem(getattr(cl, f"{role}_mesh")) for role in ROLES}
    events_problem = endpoint_problem(cl.kv_events_address)
    resource_problems = {
        f"ray.{who}_resources": resources_problem(spec)
        or (
            "" if spec.strip() else "must name a resource (a Ray bundle is not empty), e.g. 'CPU=1'"
        )
        for who in ("router", *ROLES)
        for spec in (getattr(c.ray, f"{who}_resources"),)
    }
    return [
        *((key, not why, why) for key, why in resource_problems.items()),
        (
            "scheduler.prefetch",
            not c.scheduler.prefetch or c.scheduler.policy.value != "oracle",
            "prefetch reads the hit ahead of its turn: the oracle policy reads nothing",
        ),
        ("cluster.kv_events_address", not events_problem, events_problem),
        (
            "cluster.runtime",
            cl.runtime in ("process", "thread", "ray"),
            'must be "process", "thread" or "ray"',
        ),
        (
            "cluster.runtime",
            cl.runtime != "thread" or (cl.prefill_processes == cl.decode_processes == 1),
            "thread runs every engine in one process: cluster.*_processes must be 1",
        ),
        ("cluster.prefill_cost_json", not cost_problem, cost_problem),
        *((f"cluster.{r}_mesh", not why, why) for r, why in mesh_problems.items()),
        *(
            (
                f"cluster.{r}_processes",
                getattr(cl, f"{r}_processes") == 1
                or (
                    not mesh_problems[r]
                    and mesh_size(getattr(cl, f"{r}_mesh")) % getattr(cl, f"{r}_processes") == 0
                ),
                f"must divide the devices of cluster.{r}_mesh (each process holds its share)",
            )
            for r in ROLES
        ),
        (
            "model.kv_scales",
            not m.kv_scales or m.kv_dtype in ("float8_e4m3fn", "float8_e5m2"),
            "needs an fp8 kv_dtype (float8_e4m3fn or float8_e5m2)",
        ),
        (
            "hardware.fp8",
            hw.fp8 is None or isinstance(hw.fp8, bool),
            "must be true, false or null (FP8 for DeepSeek-V3-family models)",
        ),
        (
            "hardware.ep_decode_nodes",
            hw.ep_decode_nodes <= cl.decode_nodes,
            f"must be <= cluster.decode_nodes ({cl.decode_nodes}); 0: all of them",
        ),
        (
            "hardware.kv_format",
            hw.kv_format != "fp8_flashmla" or m.is_mla,
            "fp8_flashmla applies to MLA (deepseek family) models only",
        ),
        (
            "cluster.heartbeat_timeout_s",
            cl.heartbeat_timeout_s > cl.heartbeat_s,
            f"must be > cluster.heartbeat_s ({cl.heartbeat_s})",
        ),
        (
            "workload.aps",
            # a timed trace (Mooncake, Weka, TraceLab) brings its own arrival times
            w.mode != "online" or w.aps > 0 or (bool(w.trace) and w.trace_format in TIMED_FORMATS),
            "must be > 0 in online mode",
        ),
        (
            "workload.trace_format",
            w.trace_format == "jsonl" or bool(w.trace),
            "needs a trace file (workload.trace)",
        ),
        (
            "workload.agents",
            w.agents is None or w.agents >= 1 or (w.mode == "online" and w.duration_s > 0),
            "must be >= 1 unless an online run ends after workload.duration_s",
        ),
        (
            "model.num_heads",
            m.is_mla or m.num_heads % m.num_kv_heads == 0,
            f"must be a multiple of model.num_kv_heads ({m.num_kv_heads})",
        ),
        ("model.kv_lora_rank", not m.is_mla or m.kv_lora_rank >= 1, "must be >= 1 for MLA"),
        ("model.qk_rope_head_dim", not m.is_mla or m.qk_rope_head_dim >= 1, "must be >= 1 for MLA"),
        ("model.v_head_dim", not m.is_mla or m.v_head_dim >= 1, "must be >= 1 for MLA"),
        (
            "model.num_experts_per_tok",
            not moe or 1 <= m.num_experts_per_tok <= m.n_routed_experts,
            f"must lie in [1, model.n_routed_experts ({m.n_routed_experts})]",
        ),
        (
            "model.moe_intermediate_size",
            not moe or m.moe_intermediate_size >= 1,
            "must be >= 1 with routed experts",
        ),
        (
            "model.n_routed_experts",
            not moe or m.n_routed_experts % m.n_group == 0,
            f"must be a multiple of model.n_group ({m.n_group})",
        ),
        ("model.topk_group", m.topk_group <= m.n_group, f"must be <= model.n_group ({m.n_group})"),
        (
            "model.num_experts_per_tok",
            not grouped or m.num_experts_per_tok <= group_experts,
            f"must be <= the experts in model.topk_group groups ({group_experts}) with"
            f" topk_method {m.topk_method!r}",
        ),
        (
            "model.dense_layers",
            isinstance(dense, tuple)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in dense)
            and all(0 <= i < m.num_layers for i in dense),
            f"must be a tuple of layer indices in [0, model.num_layers ({m.num_layers}))",
        ),
        (
            "model.sliding_window_layers",
            isinstance(m.sliding_window_layers, tuple)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in m.sliding_window_layers)
            and list(m.sliding_window_layers) == sorted(set(m.sliding_window_layers))
            and all(0 <= i < m.num_layers for i in m.sliding_window_layers),
            "must be a tuple of ascending distinct layer indices in"
            f" [0, model.num_layers ({m.num_layers}))",
        ),
        (
            "model.sliding_window",
            (m.sliding_window > 0) == bool(m.sliding_window_layers),
            "a window (> 0) needs model.sliding_window_layers, and those layers a window",
        ),
        ("model.qk_norm", not (m.qk_norm and m.is_mla), "applies to GQA attention only"),
        ("model.rope_factor", not yarn or m.rope_factor >= 1, "must be >= 1 with yarn RoPE"),
        (
            "model.rope_original_max_len",
            not yarn or m.rope_original_max_len >= 1,
            "must be >= 1 with yarn RoPE",
        ),
    ]


def _type_error(tp: Any, value: Any) -> str | None:
    """Why `value` is not of the field type `tp` (None if it is). Ints pass for floats."""
    if dataclasses.is_dataclass(tp) or (isinstance(tp, type) and issubclass(tp, enum.Enum)):
        ok, what = isinstance(value, tp), f"a {tp.__name__}"
    elif tp is bool:
        ok, what = isinstance(value, bool), "a bool"
    elif tp is int:
        ok, what = isinstance(value, int) and not isinstance(value, bool), "an int"
    elif tp is float:
        ok, what = isinstance(value, int | float) and not isinstance(value, bool), "a number"
    elif tp is str:
        ok, what = isinstance(value, str), "a string"
    else:
        return None
    return None if ok else f"expected {what}, got {type(value).__name__} {value!r}"


def _check_fields(obj: Any, where: str) -> None:
    for name, tp in typing.get_type_hints(type(obj)).items():
        key, value = f"{where}.{name}" if where else name, getattr(obj, name)
        args = typing.get_args(tp)
        if type(None) in args and len(args) == 2:  # `X | None`: None means "not set"
            tp = next(a for a in args if a is not type(None))
            if value is None or tp not in (int, float):  # others: checked by a relation
                continue
        why = _type_error(tp, value)
        if why:
            raise ConfigError(f"{key}: {why}")
        if dataclasses.is_dataclass(tp):
            _check_fields(value, key)
        elif tp in (int, float):
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{key}: must be finite, got {value!r}")
            rule, ok = _BOUND_OF.get(key, _DEFAULT_BOUND)
            if not ok(value):
                raise ConfigError(f"{key}: {rule}, got {value!r}")
        elif key in _CHOICES and value not in _CHOICES[key]:
            raise ConfigError(f"{key}: must be one of {list(_CHOICES[key])}, got {value!r}")


def validate(cfg: ExperimentConfig) -> ExperimentConfig:
    """Returns `cfg` unchanged, or raises ConfigError naming the first key whose type, range or
    relation to another key is wrong (so a bad value fails at startup, not deep in a run)."""
    if not isinstance(cfg, ExperimentConfig):
        raise ConfigError(f"expected an ExperimentConfig, got {type(cfg).__name__}")
    _check_fields(cfg, "")
    for key, holds, rule in _relations(cfg):
        if not holds:
            value = cfg
            for part in key.split("."):
                value = getattr(value, part)
            raise ConfigError(f"{key}: {rule}, got {value!r}")
    return cfg
