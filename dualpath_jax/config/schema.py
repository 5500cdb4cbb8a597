"""The frozen configuration dataclasses: one per section of an `ExperimentConfig` (model, hardware,
cluster, scheduler, store, workload), the enums their fields take, and `ConfigError`.

Checking a config is `validation.py`'s, reading and writing it `serialize.py`'s.
"""

from __future__ import annotations

import dataclasses
import enum


class ConfigError(ValueError):
    """A config value, key or file is invalid; the message names it."""

    __module__ = "dualpath_jax.config"  # its public home: tracebacks and the docs name it so


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
    boolean mask, the oracle), `xla` (`jax.nn.dot_product_attention`), `pallas` (the paged
    kernel) or `auto` (`model.resolve_attention_impl`: the kernel on GPU and TPU, `reference`
    on CPU, for the platform JAX finds at run time). `moe_impl`
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
    # rope_mscale_all_dim)^2 when `rope_mscale_all_dim` is set. `model.rope.Rope` computes it.
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
    # Sliding-window attention (Hugging Face `sliding_window`, `layer_types`): the layers in
    # `sliding_window_layers` keep and attend over the last `sliding_window` tokens only (0 and
    # (): none). They are the layout's "last W tokens" group (`model.layout.BlockLayout.for_model`);
    # the model forward does not compute them yet (`model.layout.UnsupportedLayout`).
    sliding_window: int = 0
    sliding_window_layers: tuple[int, ...] = ()
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
    # The paged kernel's cached pages per step of a program (0: as many as make 128 keys on GPU,
    # 512 on TPU); the same KV, so not part of its identity.
    attention_pages_per_step: int = 0
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

    def is_window_layer(self, layer: int) -> bool:
        """Whether layer `layer` attends over the last `sliding_window` tokens only."""
        return self.sliding_window > 0 and layer in self.sliding_window_layers

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

    Rates are bytes per second. The engines pace every link whose rate is > 0 as a token bucket
    (an emulated link, `transfer.links.emulated_links`, which their results and the API server
    report); 0 leaves it at the host's speed. `emulated` labels a config of emulated nodes for
    the simulator's results; it does not switch pacing off. `gpu` names a cost-model preset
    ("cpu" = fitted to the local engines).

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
    # How long an engine waits for a silent router before it stops itself (0: heartbeat_
    # timeout_s); longer lets engines outlive a router restart (docs/failures.md).
    router_timeout_s: float = 0.0
    # Rounds fail with kind `engine` once no live engine of a role has been seen for this long.
    no_engine_timeout_s: float = 30.0
    # A session with no round running for this long is closed by the router, as a CloseSession
    # without release would (its retention ends, its block claims are dropped); its client's
    # next round is refused, naming the expiry. 0: sessions never expire.
    session_idle_timeout_s: float = 3600.0
    # The router's events.jsonl is rotated once it holds this many bytes (0: never), keeping
    # `events_keep` rotated files (events.jsonl.1 the newest); readers read them all in order.
    events_max_bytes: int = 256 << 20
    events_keep: int = 4
    decode_slots: int = 8
    # Jobs a DE holds beyond its slots (waiting for a slot); the router assigns no more.
    decode_queue: int = 8
    decode_max_len: int = 4096  # tokens per decode slot
    # Decode steps per dispatch (multi-step decode, `Decoder.advance_many`): the DE runs this
    # many steps in one program when every slot has the pages for them, so the host's work per
    # dispatch (the loop, reading the tokens, one `TokensOut`) is paid once per that many
    # tokens; a request that is done mid-dispatch rides its remaining steps. Requests that ask
    # for top-k log-probabilities decode one step per dispatch.
    decode_steps: int = 1
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
    # (query, key) pair. Empty: each PE fits its own at start (`engines.calibrate`).
    prefill_cost_json: str = ""
    fetch_interval_s: float = 0.005  # how often a leader engine fetches and heartbeats
    # The C heap of the router's and engines' processes (runtimes/malloc.py, glibc only): malloc
    # arenas at most (0: glibc's default, 8 per core; each thread's arena keeps what it frees),
    # and how often free heap pages are handed back to the system (malloc_trim; 0: never).
    malloc_arena_max: int = 2
    malloc_trim_s: float = 60.0
    # Compile before registering (engines/warmup.py): every prefill shape bucket (batch sizes
    # padded to powers of two, new-token and cached-context buckets) and every decode step
    # width, so the serving path compiles nothing; the HTTP server reports ready only after.
    # Off: shapes compile on first use (tests and short experiments start faster).
    warmup: bool = False
    # JAX's persistent compilation cache of engine processes (every compile cached): empty =
    # the directory JAX_COMPILATION_CACHE_DIR names, else `<workdir>/jax_cache`.
    compilation_cache_dir: str = ""
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
    # An engine serving other params than the cluster (restarted after an update, or registered
    # during one) gets no work until it has loaded the served ones; one that could not load them
    # is asked again after this long.
    params_retry_s: float = 10.0
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
    # "process" (`LocalCluster`: the router and each engine a process of its own), "thread"
    # (`InProcessCluster`: the same code as threads of one process; fast to start, one JAX
    # runtime; identical tokens) or "ray" (`RayCluster`: each process owned by a Ray actor, on
    # the Ray the process is connected to or a local one; placed as the `ray` section says).
    runtime: str = "process"
    # Which devices an engine process gets (`runtimes.devices`): "cpu", "gpu" or "tpu" gives each
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
    # read at the storage NIC's rate, or where it is not emulated (`hardware.snic_bytes_per_s`
    # 0) at the read rate the router measures), or "always" (recompute every hit: the baseline
    # without a KV store).
    recompute: str = "never"
    # At most this many leading hit blocks are recomputed per request (0: no limit); the rest
    # is read. With "always": recompute exactly the first min(hit, this) blocks.
    recompute_max_blocks: int = 0
    # Tool-gap prefetch (beyond the paper; docs/policies.md#tool-gap-prefetch): during a tool
    # call's gap, read the session's hit into a node's memory, on the side the policy would read
    # it (PE for basic/layerwise; for dualpath, dualpath_rr and split the side with the
    # shorter read queue), at the storage NIC's lowest priority. Not with oracle (no reads).
    prefetch: bool = False
    prefetch_bytes_per_engine: float = 0.0  # DRAM per engine for it; 0: dram_buffer_bytes
    prefetch_min_gap_s: float = 0.5  # shorter expected gaps are not prefetched
    prefetch_hold_factor: float = 3.0  # cancelled past this x the expected gap
    prefetch_affinity_slack: float = 0.5  # see sched.prefetch.honor_affinity
    # A round whose prompt equals that of a round in flight still waiting for its first token
    # follows it (as a group sample does, `Submit.follows`): it forks that round's prompt KV
    # on its decode engine instead of reading and prefilling it again. Off: only explicit
    # followers (`Client.submit_group`) fork.
    fork_identical: bool = False


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    """Where Full Blocks live. `kind` is file, memory, or spec (then `spec_json` is a kvstore spec)."""

    kind: str = "file"
    root: str = ""  # empty: <workdir>/store
    spec_json: str = ""
    block_tokens: int = 64
    fsync: bool = False
    # The bytes a store may hold, each process enforcing it on its own view. 0: derived from
    # the disk of a local store (capacity_fraction of its free bytes plus those the store holds
    # at open; unlimited for memory and remote stores); -1: unlimited (kvstore/capacity.py).
    capacity_bytes: int = 0
    capacity_fraction: float = 0.5  # of the local disk's room, when capacity_bytes is 0
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
    # Trace file path (a directory of session files for `weka`), in `trace_format`: jsonl |
    # mooncake | conversation | weka | tracelab (docs/traces.md). A run that switches to a trace
    # (`launcher.run_config`: --trace, or a --set of workload.trace) replays it as recorded: the
    # source's knobs (`SOURCE_KNOBS`: agents, length_scale, max_len, max_turns) of the config
    # file are reset unless the run sets them too.
    trace: str = ""
    trace_format: str = "jsonl"
    trace_block_tokens: int = 512  # tokens per hash id in a Mooncake trace (before length_scale)
    trace_sessions: bool = True  # Mooncake: group continuing requests into trajectories
    trace_bytes_per_token: float = 4.0  # conversation files: UTF-8 bytes per token
    trajectories: int = 8
    # Agents replaying the trajectories: more than there are expands them (appendix A.3 copies
    # with a synthetic first round), fewer keeps the first ones. None: one agent per trajectory.
    agents: int | None = 8
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


# The workload fields that shape a workload source rather than the run: what a trace replayed as
# recorded takes (`launcher.run_config` resets the config file's values to these when a run
# switches the source to a trace and does not set them itself).
SOURCE_KNOBS: dict[str, object] = {
    "agents": None,
    "length_scale": 1.0,
    "max_len": 0,
    "max_turns": 0,
}


@dataclasses.dataclass(frozen=True)
class RayConfig:
    """How `RayCluster` places the router and the engines as Ray actors (docs/multihost.md, "On
    Ray"): one placement group per cluster, a bundle per actor of its role's resources."""

    # Each actor's bundle, "NAME=AMOUNT,..." as Ray names resources: CPU, GPU, TPU or a custom
    # one a node pool advertises (`ray start --resources`), which pins a role to those nodes.
    router_resources: str = "CPU=1"
    prefill_resources: str = "CPU=1"
    decode_resources: str = "CPU=1"
    strategy: str = "PACK"  # the placement group's: PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
    # An engine spanning processes (`cluster.*_processes` > 1) gets a placement group of its own,
    # a bundle of its role's resources per process, with this strategy: STRICT_PACK keeps its
    # processes on one node; STRICT_SPREAD puts each on its own (then ray.bind_node_ip).
    span_strategy: str = "STRICT_PACK"
    # Times Ray restarts an engine actor that died (its node, its process); the router is not
    # restarted.
    max_restarts: int = 3
    # The store root and the workdir are on a file system every node mounts at the same path
    # (NFS, gcsfuse): a "file" store is refused on a multi-node Ray cluster without it.
    shared_filesystem: bool = False
    # The router and each engine's transfer server bind the address of the node their actor runs
    # on (instead of cluster.host / cluster.transfer_host): on for a cluster of several hosts.
    bind_node_ip: bool = False


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    name: str = "default"
    model: ModelConfig = ModelConfig()
    hardware: HardwareConfig = HardwareConfig()
    cluster: ClusterConfig = ClusterConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    store: StoreConfig = StoreConfig()
    workload: WorkloadConfig = WorkloadConfig()
    ray: RayConfig = RayConfig()
    seed: int = 0
