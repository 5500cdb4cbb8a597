"""Frozen configuration dataclasses, JSON round trip and typed `key=value` overrides.

Every part of dualpath_jax takes its configuration as one of these dataclasses; nothing in the
library reads flags or environment variables. Experiment files in `configs/` build an
`ExperimentConfig` with `get_config(arg)`, and launchers apply `--set section.key=value` overrides
through `apply_overrides`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value, key or file is invalid; the message names it."""


class ModelFamily(enum.StrEnum):
    """The architecture a model follows (`ModelConfig.is_mla` is the DeepSeek families')."""

    QWEN2 = "qwen2"  # dense GQA decoder (Qwen2 / Qwen2.5)
    QWEN3 = "qwen3"  # dense GQA decoder with per-head q/k RMSNorm (Qwen3)
    QWEN3_MOE = "qwen3_moe"  # Qwen3 attention + softmax-routed MoE (Qwen3-MoE)
    DEEPSEEK_V2 = "deepseek_v2"  # MLA attention + softmax-routed MoE (DeepSeek-V2, V2-Lite)
    DEEPSEEK = "deepseek"  # MLA attention + MoE (DeepSeek-V3 family)


_MLA_FAMILIES = (ModelFamily.DEEPSEEK, ModelFamily.DEEPSEEK_V2)


class Policy(enum.StrEnum):
    """Loading policies compared by the launchers (paper section 7 baselines + DualPath)."""

    BASIC = "basic"  # no layerwise prefill, PE read path only
    LAYERWISE = "layerwise"  # layerwise prefill, PE read path only
    DUALPATH_RR = "dualpath_rr"  # dual-path loading, round-robin engines and read sides
    DUALPATH = "dualpath"  # dual-path loading + the paper's scheduler
    SPLIT = "split"  # one request's hit blocks split between both read paths
    ORACLE = "oracle"  # storage, H2D/D2H and PE->DE transfers bypassed


KV_SCALE_TILE = 128  # MLA latent columns per fp8 KV scale (`ModelConfig.kv_scales`)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of one model. Dimensions follow the Hugging Face config names.

    The Qwen families use `num_kv_heads`/`head_dim` (Qwen3 adds `qk_norm`); the DeepSeek
    families use the MLA fields (`kv_lora_rank`, `qk_rope_head_dim`, ...). Qwen3-MoE and the
    DeepSeek families use the MoE fields. `dtype` is the parameter/compute dtype and
    `kv_dtype` the dtype of cached KV (what a Layer Block holds). `attention_impl` picks the
    attention backend (`model.layers.ATTENTION_IMPLS`): `reference` (dense scores under a
    boolean mask, the oracle), `xla` (`jax.nn.dot_product_attention`, cuDNN's fused kernel where
    JAX can use it) or `auto` (the best one for the platform JAX finds at run time). `moe_impl`
    picks the routed experts' grouped matmul (`model.moe.MOE_IMPLS`): `ragged_dot` (the oracle),
    `grouped` (tiled, memory-bounded), `gmm` (Pallas megablox) or `auto`.
    """

    name: str = "tiny-qwen2"
    family: ModelFamily = ModelFamily.QWEN2
    vocab_size: int = 257
    hidden_size: int = 64
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 160
    max_seq_len: int = 8192
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = True
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3), GQA only
    # RoPE scaling (Hugging Face `rope_parameters`): "default" (none) or "yarn". Yarn blends the
    # inverse frequencies divided by `rope_factor` with the original ones over the band between
    # `rope_beta_fast` and `rope_beta_slow` rotations in `rope_original_max_len` positions
    # (band edges rounded outwards when `rope_truncate`), and scales cos/sin by
    # `rope_attention_factor` (0: derived from `rope_factor`, `rope_mscale`, `rope_mscale_all_dim`
    # as transformers does). MLA also scales its softmax by mscale(rope_factor,
    # rope_mscale_all_dim)^2 when `rope_mscale_all_dim` is set. `model.layers.Rope` computes it.
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_original_max_len: int = 0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    rope_attention_factor: float = 0.0
    rope_truncate: bool = True
    # MLA (DeepSeek families).
    q_lora_rank: int = 0  # 0: queries are not low-rank compressed
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    # MoE (DeepSeek and Qwen3-MoE families). Layer i has routed experts when
    # i >= first_k_dense_replace, (i + 1) % moe_layer_step == 0 and i is not in dense_layers
    # (`is_moe_layer`); the other layers have a dense MLP of `intermediate_size`.
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_step: int = 1  # Qwen3-MoE's decoder_sparse_step
    dense_layers: tuple[int, ...] = ()  # Qwen3-MoE's mlp_only_layers
    # Routing: expert scores are the sigmoid or the softmax of the router logits (`moe_scoring`);
    # the top `num_experts_per_tok` are chosen over all experts (`topk_method` "greedy"), or
    # within the `topk_group` best of `n_group` expert groups, groups ranked by their best score
    # ("group_limited_greedy", DeepSeek-V2) or, with the score-correction bias added to the
    # scores for the choice only, by the sum of their best two ("noaux_tc", DeepSeek-V3). The
    # chosen scores, normalized to sum 1 if `norm_topk_prob`, times `routed_scaling_factor`,
    # weight the experts' outputs.
    moe_scoring: str = "sigmoid"  # "sigmoid" | "softmax"
    topk_method: str = "noaux_tc"  # "greedy" | "group_limited_greedy" | "noaux_tc"
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    # DeepSeek sparse attention (V3.2): used by the cost models only.
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    dtype: str = "float32"
    kv_dtype: str = "float32"
    # fp8 KV with scales: each cached row ends in one float32 scale per token per segment (GQA:
    # each K and each V head; MLA: each 128 latent columns and the RoPE part), written when the
    # row is made and applied by the attention kernels page by page. Needs a 1-byte kv_dtype.
    kv_scales: bool = False
    attention_impl: str = "auto"  # "auto" | "reference" | "xla" | "pallas"
    moe_impl: str = "auto"  # "auto" | "ragged_dot" | "grouped" | "gmm"

    @property
    def is_mla(self) -> bool:
        return self.family in _MLA_FAMILIES

    @property
    def kv_width(self) -> int:  # == kernels.kv_rows.RowLayout.for_model(self).row_width
        """Elements of cached KV per token per layer (the last axis of a layer's KV rows; with
        `kv_scales`, 4 one-byte elements per scale follow the data)."""
        if self.is_mla:
            data = self.kv_lora_rank + self.qk_rope_head_dim
            scales = -(-self.kv_lora_rank // KV_SCALE_TILE) + 1
        else:
            data = 2 * self.num_kv_heads * self.head_dim
            scales = 2 * self.num_kv_heads
        return data + 4 * scales if self.kv_scales else data

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer `layer` has routed experts (else a dense MLP)."""
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and (layer + 1) % self.moe_layer_step == 0
            and layer not in self.dense_layers
        )


@dataclasses.dataclass(frozen=True)
class HardwareConfig:
    """Link rates and capacities of one node kind. A rate of 0 means unlimited (real hardware).

    Rates are bytes per second. `emulated` marks token-bucket emulation on one host, which every
    result reports. `gpu` names a cost-model preset ("cpu" = fitted to the local engines).

    The GPU cost model (`gpu` a GPU preset; `presets.config_cost_model(cfg)` builds it, and
    `sim.simulate(cfg)` uses it when given none) is the roofline of `gpu` with `calibration`
    (`"hopper"`: fitted to DeepSeek's published H800 serving, `presets.hopper_calibration`;
    `"none"`: the bare roofline at the GPU's kernel efficiency), FP8 weights and GEMMs when `fp8`
    (None: for DeepSeek-V3-family models, whose checkpoints are FP8), routed experts spread over the
    GPUs of `ep_decode_nodes` decode nodes (0: all of them; a dense model has none to spread)
    and KV of `kv_format` (`model.layout.kv_bytes_per_token`: "" = `model.kv_dtype`,
    `"fp8_flashmla"` = DeepSeek's FP8 FlashMLA layout, or a dtype name), which also sizes the
    simulator's KV transfers. The local engines store KV as `model.kv_dtype` whatever it says.
    """

    gpu: str = "cpu"
    engines_per_node: int = 1
    snic_bytes_per_s: float = 0.0  # one storage NIC per node
    cnic_bytes_per_s: float = 0.0  # one compute NIC per engine
    h2d_bytes_per_s: float = 0.0
    d2h_bytes_per_s: float = 0.0
    dram_bytes_per_s: float = 0.0
    hbm_bytes: float = 0.0  # per engine, for KV (0: derived from the decode slots)
    dram_buffer_bytes: float = 2**26  # PE/DE host buffer per engine process (KV staging)
    high_weight: float = 99.0  # weighted arbitration HIGH:LOW, like IB virtual lanes
    low_weight: float = 1.0
    emulated: bool = False
    calibration: str = "hopper"  # "hopper" | "none"
    fp8: bool | None = None  # None: FP8 for DeepSeek-V3-family models
    ep_decode_nodes: int = 0  # decode nodes per expert-parallel group, 0: all
    kv_format: str = ""  # "": model.kv_dtype; "fp8_flashmla"; a dtype name


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """P prefill and D decode nodes, each with `HardwareConfig.engines_per_node` engines."""

    prefill_nodes: int = 1
    decode_nodes: int = 1
    pe_group_size: int = 1  # engines fetching through one leader
    de_group_size: int = 1
    host: str = "127.0.0.1"  # the control plane's bind address
    router_port: int = 0  # 0: pick a free port
    # A 0600 JSON file {"engine": ..., "client": ...} of the two secrets (engine/admin and
    # client); required for non-loopback hosts. Empty: `LocalCluster` writes a fresh one into
    # its workdir. Secrets never travel on command lines or in config.json.
    secrets_file: str = ""
    # Where the KV transfer server listens. It is unauthenticated and aborts on malformed
    # input (an upstream limitation, docs/failures.md): loopback by default; a private address
    # names the cluster's own network; a public or wildcard one needs the next flag.
    transfer_host: str = "127.0.0.1"
    transfer_untrusted_network_ok: bool = False
    # Where the router publishes KV events (blocks stored / removed, docs/kv_events.md) on a
    # ZeroMQ PUB socket, `tcp://127.0.0.1:5557` (port 0: a free one, shown in the router's
    # stats); "": off. A non-loopback host needs secrets_file, as the control plane does.
    kv_events_address: str = ""
    heartbeat_s: float = 1.0
    heartbeat_timeout_s: float = 10.0
    # Rounds fail with kind `engine` once no live engine of a role has been seen for this long.
    no_engine_timeout_s: float = 30.0
    decode_slots: int = 8
    # Jobs a DE holds beyond its slots (waiting for a slot); the router assigns no more.
    decode_queue: int = 8
    decode_max_len: int = 4096  # tokens per decode slot
    # The DE's device KV budget, held in pages of store.block_tokens tokens (all layers): bytes,
    # or a fraction of the device's memory (where the platform reports it); both 0: room for
    # every slot at decode_max_len. With less, a request is admitted once its pages (prompt +
    # gen tokens) are free; until then it waits in the DE's queue.
    decode_kv_bytes: int = 0
    decode_kv_fraction: float = 0.0
    # Each engine's host buffer (the PE buffer or DE buffer: KV staged in host memory) holds at
    # least this many tokens of the served model's KV, every layer (64K: a long agentic
    # context of any model), and at least `hardware.dram_buffer_bytes`. A request whose prompt
    # (DE) or hit (PE) needs more than the whole buffer fails with an error naming both.
    host_buffer_tokens: int = 65536
    # The host buffers' memory: "pinned_host" (page-locked, through JAX's memory kinds: the
    # device copies layers from it by DMA) or "pageable" (a numpy slab).
    host_buffer_memory: str = "pinned_host"
    prefill_max_batch: int = 8
    prefill_max_tokens: int = 2048  # new tokens per forward batch (bounds padding and memory)
    # Context (cached + new tokens) one PE forward batch may hold on the device, 0: unbounded.
    # Without layerwise prefill (Basic) every layer of it is resident, with it one layer at a
    # time, so the bound is `num_layers` times larger there (the first chunk always runs).
    prefill_max_kv_tokens: int = 0
    # The PEs' prefill cost model (compute quota, beta) as `sched.cost.FittedCostModel` JSON,
    # `{"prefill": [p0, p1, p2]}`: seconds per forward batch, per new token, per attention
    # (query, key) pair. Empty: each PE fits its own at start (`engine.calibrate`).
    prefill_cost_json: str = ""
    fetch_interval_s: float = 0.005  # how often a leader engine fetches and heartbeats
    transfer_timeout_s: float = 60.0
    # How long a DE waits for its PE to begin prefilling a request (the PE's queue under load);
    # transfer_timeout_s bounds each transfer once it has begun.
    prefill_start_timeout_s: float = 300.0
    max_attempts: int = 5  # tries of a request whose engines failed (transfer errors, deaths)
    # Served parameters: empty = `init_model(model, seed)`; else a checkpoint directory every
    # engine reads (orbax `params/`, or Hugging Face config.json + safetensors).
    params_path: str = ""
    # Names the served params in block keys; empty with a params_path: derived from the path
    # (set it when a path is overwritten with other params, or stored KV would be reused).
    params_version: str = ""
    params_load_timeout_s: float = 600.0  # engines that have not loaded an update by then abort it
    # Testing only: a JSON fault plan (dualpath_jax.testing) the engines' store and channel obey.
    fault_file: str = ""
    # Each engine's devices (docs/multihost.md). An engine runs the model on a mesh of its role's
    # shape, "data=2,tensor=4" (axes `MESH_AXES`; "": one device), over the first devices it sees.
    prefill_mesh: str = ""
    decode_mesh: str = ""
    # Processes one engine spans, by role (docs/multihost.md): its mesh (`prefill_mesh` /
    # `decode_mesh`) covers the devices of all of them, one `jax.distributed` group per engine;
    # process 0 is the engine the router knows and the others replay its device work.
    prefill_processes: int = 1
    decode_processes: int = 1
    # How `run_local` (launch/rollout.py, make demo, bench/compare_policies.py) runs the cluster:
    # "process" (`LocalCluster`: the router and each engine a process of its own) or "thread"
    # (`InProcessCluster`: the same code as threads of one process; fast to start, one JAX
    # runtime; identical tokens).
    runtime: str = "process"
    # Which devices an engine process gets (`engine.devices`): "cpu", "gpu" or "tpu" gives each
    # its own, as many as its role's mesh spans (disjoint GPUs or TPU chips, PEs first; on CPU,
    # that many host devices in each engine process); "" leaves every engine each device the host
    # shows (so `LocalCluster`, whose engines share a host, allows one-device meshes only).
    platform: str = ""
    # The fraction of each device's memory an engine process may preallocate (GPU:
    # XLA_PYTHON_CLIENT_MEM_FRACTION); 0: JAX's default.
    device_memory_fraction: float = 0.0


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler constants (paper section 6 and appendix A.4). 0 means derive from hardware."""

    policy: Policy = Policy.DUALPATH
    alpha_tokens: float = 0.0  # read-queue threshold; 0: tokens the node reads in alpha_s
    beta_tokens: float = 0.0  # overload threshold; 0: tokens one engine processes in beta_s
    alpha_s: float = 3.0
    beta_s: float = 5.0
    compute_quota_ms: float = 300.0
    z_factor: float = 1.05
    max_queue: int = 100_000
    # Load or recompute a request's hit KV: "never" (always load it, the paper), "auto" (per
    # request, recompute the leading part of the hit, all of it or none, that the PE's cost
    # model says finishes first against the reads: the chosen node's read queue plus the blocks
    # read at the storage NIC's rate), or "always" (recompute every hit: the baseline without
    # a KV store).
    recompute: str = "never"
    # At most this many leading hit blocks are recomputed per request (0: no limit); the rest
    # is read. With "always": recompute exactly the first min(hit, this) blocks.
    recompute_max_blocks: int = 0


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    """Where Full Blocks live. `kind` is file, memory, or spec (then `spec_json` is a kvstore spec)."""

    kind: str = "file"
    root: str = ""  # empty: <workdir>/store
    spec_json: str = ""
    block_tokens: int = 64
    fsync: bool = False
    capacity_bytes: int = 0  # 0: unlimited (each process enforces it on its own view)
    # Which blocks go first when capacity_bytes is reached: "lru", or "retention" (a session's
    # blocks stay while its round runs and for its TTL after, by priority; docs/kv_events.md).
    eviction: str = "retention"
    retention_ttl_s: float = 60.0  # a session's default TTL after each round (a tool call's gap)
    io_concurrency: int = 16  # concurrent block I/Os per store (file driver limit, read window)
    timeout_s: float = 60.0  # a single block I/O taking longer fails with StoreError


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    """Which trajectories to run and when they arrive."""

    preset: str = "64k"  # synthetic preset (Table 2), unless `trace` is set
    trace: str = ""  # trace file path (format: trace_format)
    trace_format: str = "jsonl"  # jsonl | mooncake | conversation (docs/traces.md)
    trace_block_tokens: int = 512  # tokens per hash id in a Mooncake trace (before length_scale)
    trace_sessions: bool = True  # Mooncake: group continuing requests into trajectories
    trace_bytes_per_token: float = 4.0  # conversation files: UTF-8 bytes per token
    trajectories: int = 8
    agents: int = 8
    mode: str = "offline"  # offline | online
    aps: float = 0.0
    duration_s: float = 0.0
    append_scale: float = 1.0
    gen_scale: float = 1.0
    length_scale: float = 1.0  # scales every length of a preset (CPU-sized replays)
    max_len: int = 0  # 0: the preset's MaxLen
    max_turns: int = 0  # 0: every round; else trajectories keep their first max_turns rounds
    # Tool calls between rounds: a mean gap in seconds (0: none) given to every round after the
    # first that its trace does not time; log-normal with this shape (workload.arrivals.tool_gaps).
    tool_gap_s: float = 0.0
    tool_gap_sigma: float = 1.0
    seed: int = 0
    ttft_slo_s: float = 4.0
    tpot_slo_s: float = 0.05


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    name: str = "default"
    model: ModelConfig = ModelConfig()
    hardware: HardwareConfig = HardwareConfig()
    cluster: ClusterConfig = ClusterConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    store: StoreConfig = StoreConfig()
    workload: WorkloadConfig = WorkloadConfig()
    seed: int = 0


# --------------------------------------------------------------------------- JSON round trip


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-ready dict of a config dataclass (enums as their values)."""

    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, enum.Enum):
            return v.value
        if isinstance(v, tuple | list):
            return [conv(x) for x in v]
        return v

    return conv(cfg)


def to_json(cfg: Any, **kw: Any) -> str:
    return json.dumps(to_dict(cfg), **kw)


def from_dict(cls: type[T], data: dict[str, Any], where: str = "") -> T:
    """Builds `cls` from a dict, checking every key and value type."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or cls.__name__}: expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"{where or cls.__name__}: unknown key(s) {unknown}; known: {sorted(names)}"
        )
    kwargs = {}
    for name, value in data.items():
        key = f"{where}.{name}" if where else name
        kwargs[name] = _coerce(hints[name], value, key)
    return cls(**kwargs)


def from_json(cls: type[T], text: str) -> T:
    """Parses `cls` from JSON; an ExperimentConfig is also validated (`validate`)."""
    cfg = from_dict(cls, json.loads(text))
    if isinstance(cfg, ExperimentConfig):
        validate(cfg)
    return cfg


def _coerce(tp: Any, value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError("; ".join(errors))
    if origin is tuple:
        (elem, *_rest) = typing.get_args(tp)
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return tuple(_coerce(elem, v, key) for v in value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(f"{key}: {value!r} is not one of {[m.value for m in tp]}") from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected a bool, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an int, got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


# --------------------------------------------------------------------------- overrides


def _parse_scalar(tp: Any, text: str, key: str) -> Any:
    """Parses the text of a `key=value` override into the field's type."""
    if tp is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key}: expected a bool (true/false), got {text!r}")
    if tp is int:
        try:
            return int(text.replace("_", ""))
        except ValueError:
            try:
                f = float(text)
            except ValueError:
                raise ConfigError(f"{key}: expected an int, got {text!r}") from None
            if not f.is_integer():
                raise ConfigError(f"{key}: expected an int, got {text!r}") from None
            return int(f)
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{key}: expected a number, got {text!r}") from None
    if tp is str:
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = text
    return _coerce(tp, value, key)


def apply_overrides(cfg: T, overrides: typing.Iterable[str]) -> T:
    """Returns `cfg` with each `a.b.c=value` override applied, typed by the target field."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
        path, text = item.split("=", 1)
        cfg = _set_path(cfg, path.strip().split("."), text, path.strip())
    return cfg


def _set_path(obj: Any, parts: list[str], text: str, full: str) -> Any:
    if not dataclasses.is_dataclass(obj):
        raise ConfigError(f"override {full!r}: {type(obj).__name__} has no fields")
    names = {f.name for f in dataclasses.fields(obj)}
    head = parts[0]
    if head not in names:
        raise ConfigError(
            f"override {full!r}: unknown key {head!r} in {type(obj).__name__}; known: {sorted(names)}"
        )
    hints = typing.get_type_hints(type(obj))
    if len(parts) == 1:
        value = _parse_scalar(hints[head], text, full)
    else:
        value = _set_path(getattr(obj, head), parts[1:], text, full)
    return dataclasses.replace(obj, **{head: value})


# --------------------------------------------------------------------------- mesh specs

MESH_AXES = ("data", "tensor", "expert")  # the mesh axes the partition rules know (model.sharding)
ROLES = ("prefill", "decode")  # engine roles; `cluster.<role>_mesh` is each one's mesh


def parse_mesh(spec: str | typing.Mapping[str, int]) -> dict[str, int]:
    """A mesh shape from `"data=2,tensor=4"` (a config string; "" = one device) or a mapping,
    checked: known axis names, sizes >= 1, each axis once. Axes keep `MESH_AXES` order."""
    if isinstance(spec, typing.Mapping):
        items = list(spec.items())
    else:
        items = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, sep, size = part.partition("=")
            if not sep or not size.strip().isdigit():
                raise ValueError(f"mesh {spec!r}: expected 'axis=size,...' (axes {MESH_AXES})")
            items.append((name.strip(), int(size)))
    names = [n for n, _ in items]
    for name, size in items:
        if name not in MESH_AXES:
            raise ValueError(f"mesh axis {name!r} is not one of {MESH_AXES}")
        if int(size) < 1:
            raise ValueError(f"mesh axis {name!r} has size {size}; sizes must be >= 1")
    if len(set(names)) != len(names):
        raise ValueError(f"mesh {spec!r} names an axis twice")
    shape = dict(items)
    return {a: int(shape[a]) for a in MESH_AXES if a in shape}


def mesh_size(spec: str | typing.Mapping[str, int]) -> int:
    """Devices a mesh spec spans (1 for "")."""
    return math.prod(parse_mesh(spec).values()) if spec else 1


def _mesh_problem(spec: str) -> str:
    """Why `spec` is not a mesh spec ("" if it is one)."""
    try:
        parse_mesh(spec)
    except ValueError as e:
        return f"{e} (a mesh is written 'data=2,tensor=4'; empty: one device)"
    return ""


# --------------------------------------------------------------------------- addresses


def parse_endpoint(address: str) -> tuple[str, int]:
    """`(host, port)` of a `tcp://HOST:PORT` ZeroMQ endpoint (an IPv6 host in brackets; port 0:
    any free port); raises ValueError for anything else."""
    scheme, sep, rest = address.partition("://")
    host, colon, port = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # an IPv6 literal without brackets
    if scheme != "tcp" or not sep or not colon or not host or not port.isdigit():
        raise ValueError(f"{address!r} is not a tcp://HOST:PORT address (IPv6: tcp://[::1]:PORT)")
    if int(port) > 65535:
        raise ValueError(f"{address!r}: port {port} is not in [0, 65535]")
    return host, int(port)


def _endpoint_problem(address: str) -> str:
    """Why `address` is neither "" nor a `tcp://HOST:PORT` endpoint ("" if it is one)."""
    try:
        if address:
            parse_endpoint(address)
    except ValueError as e:
        return str(e)
    return ""


# --------------------------------------------------------------------------- validation

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
        " cluster.decode_slots cluster.decode_max_len cluster.max_attempts cluster.decode_processes"
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
        " cluster.prefill_start_timeout_s"
        " scheduler.alpha_s scheduler.beta_s scheduler.compute_quota_ms scheduler.z_factor"
        " store.timeout_s workload.length_scale workload.ttft_slo_s workload.tpot_slo_s"
        " workload.trace_bytes_per_token",
    ),
    ("must lie in [0, 65535]", lambda v: 0 <= v <= 65535, "cluster.router_port"),
    (
        "must lie in [0, 1]",
        lambda v: 0 <= v <= 1,
        "cluster.decode_kv_fraction cluster.device_memory_fraction",
    ),
    ("must lie in [0, 2**63)", lambda v: 0 <= v < 2**63, "seed workload.seed"),
)
_BOUND_OF = {key: (rule, ok) for rule, ok, keys in _BOUNDS for key in keys.split()}
_DEFAULT_BOUND = ("must be >= 0", lambda v: v >= 0)

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
    "workload.trace_format": ("jsonl", "mooncake", "conversation"),  # workload.formats.FORMATS
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
    mesh_problems = {role: _mesh_problem(getattr(cl, f"{role}_mesh")) for role in ROLES}
    events_problem = _endpoint_problem(cl.kv_events_address)
    return [
        ("cluster.kv_events_address", not events_problem, events_problem),
        ("cluster.runtime", cl.runtime in ("process", "thread"), 'must be "process" or "thread"'),
        (
            "cluster.runtime",
            cl.runtime == "process" or (cl.prefill_processes == cl.decode_processes == 1),
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
            # a Mooncake trace brings its own arrival times
            w.mode != "online" or w.aps > 0 or (bool(w.trace) and w.trace_format == "mooncake"),
            "must be > 0 in online mode",
        ),
        (
            "workload.trace_format",
            w.trace_format == "jsonl" or bool(w.trace),
            "needs a trace file (workload.trace)",
        ),
        (
            "workload.agents",
            w.agents >= 1 or (w.mode == "online" and w.duration_s > 0),
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
