"""The roofline's calibration to published serving throughput, and the cost models of presets.

A roofline at a good kernel's efficiency ignores what an inference system loses between kernels
(expert all-to-all, load imbalance, chunking, launch gaps). `calibrate` solves two constants, the
end-to-end prefill efficiency and the per-step decode overhead, from a published measurement
(`PublishedServing`; `DEEPSEEK_V3_SERVING`, DeepSeek's V3/R1 serving on H800 nodes, gives
`hopper_calibration()`), see docs/simulator.md.

`make_cost_model(hw, model, ...)` builds the cost model of a GPU preset and a model: the roofline
(`sched.cost.RooflineCostModel`) of `hw.gpu` with the calibration `hw.calibration` names
(`CALIBRATIONS`), `hw.fp8` and `hw.kv_format`; `config_cost_model(cfg)` is that of a whole
`ExperimentConfig`, routed experts spread over the GPUs of `hardware.ep_decode_nodes` decode
nodes (the cost model `sim.simulate(cfg)` uses when given none). `sizing_cost(name)` is the
`ModelCost` of a model preset or of a sizing-only one (`presets.models.SIZING_MODELS`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from dualpath_jax.config import ExperimentConfig, HardwareConfig, ModelConfig, ModelFamily
from dualpath_jax.presets.gpus import get_gpu
from dualpath_jax.presets.models import (
    GPT_OSS_120B,
    GPT_OSS_WINDOW,
    GPT_OSS_WINDOW_LAYERS,
    PRESETS,
    QWEN3_235B_A22B,
    SIZING_MODELS,
    get_preset,
)
from dualpath_jax.sched.cost import CostModel, FittedCostModel, ModelCost, RooflineCostModel

# The prefill cost model `engines.calibrate` fits for the tiny models (TINY_QWEN2, 16-token blocks)
# on one CPU core: p0 + p1 * new tokens + p2 * attention pairs seconds per forward. Clusters that
# pin it (`cluster.prefill_cost_json=TINY_CPU_PREFILL_COST.to_json()`, as the tests' clusters do)
# start without calibrating; their PEs batch as a calibrated one would, within the machine's noise.
TINY_CPU_PREFILL_COST = FittedCostModel(prefill=(0.005, 4.4e-5, 5.9e-8))

# --------------------------------------------------------------------------- calibration


@dataclasses.dataclass(frozen=True)
class PublishedServing:
    """A published production serving measurement to calibrate a roofline against.

    `prefill_tokens_per_s` counts prompt tokens including cache hits, per node;
    `context_tokens` is the mean prompt length of a prefill; `decode_*` the decode side (a
    user's output rate gives the decode step time, the node's output rate the batch).
    """

    source: str
    model: str  # a `presets.PRESETS` name
    gpu: str
    gpus_per_node: int
    prefill_tokens_per_s: float
    hit_rate: float
    context_tokens: int
    prefill_expert_parallel: int
    decode_tokens_per_s: float
    user_tokens_per_s: float
    decode_expert_parallel: int
    kv_format: str | None = None


# DeepSeek's inference-system overview (open-source week, day 6, March 2025), V3/R1 on H800:
# 73.7k input tokens/s per node during prefill including the 56.3% of tokens that hit the on-disk
# KV cache; 14.8k output tokens/s per node during decode at 20-22 tokens/s per user; mean KV
# length per output token 4,989 (taken here as the mean prompt length); prefill EP32, decode EP144.
DEEPSEEK_V3_SERVING = PublishedServing(
    source="DeepSeek-V3/R1 inference system overview (2025-03)",
    model="deepseek-v3-660b",
    gpu="h800",
    gpus_per_node=8,
    prefill_tokens_per_s=73.7e3,
    hit_rate=0.563,
    context_tokens=4989,
    prefill_expert_parallel=32,
    decode_tokens_per_s=14.8e3,
    user_tokens_per_s=21.0,
    decode_expert_parallel=144,
)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What a roofline misses, fitted to a published measurement: the fraction of peak FLOP/s a
    prefill forward reaches end to end (GEMMs, attention, expert all-to-all, imbalance) and the
    per-step decode time beyond the roofline."""

    prefill_efficiency: float
    decode_overhead_s: float
    source: str
    moe_layers: int = 0  # of the calibrated model: the overhead is paid per MoE layer

    def overhead_for(self, model: ModelCost) -> float:
        """The decode overhead of `model`: expert-parallel dispatch and combine (and the bubbles
        around them) happen once per MoE layer, so the calibrated step overhead is scaled by the
        model's MoE layers over the calibrated model's (a dense model pays none)."""
        if not self.moe_layers:
            return self.decode_overhead_s
        return self.decode_overhead_s * model.moe_layers / self.moe_layers

    def apply(self, roofline: RooflineCostModel) -> RooflineCostModel:
        return dataclasses.replace(
            roofline,
            prefill_efficiency=self.prefill_efficiency,
            decode_overhead_s=self.overhead_for(roofline.model),
        )


def calibrate(pub: PublishedServing = DEEPSEEK_V3_SERVING, *, fp8: bool = True) -> Calibration:
    """Solves the roofline's prefill efficiency and decode overhead so that it reproduces `pub`.

    Prefill: one GPU must prefill `prefill_tokens_per_s / gpus_per_node` prompt tokens per
    second of requests `(hit_rate * context, rest)` (compute bound: the time is linear in the
    batch); efficiency = peak-rate time / that time. Decode: the step time is `1 /
    user_tokens_per_s` at batch `decode_tokens_per_s / gpus_per_node * step`; the overhead is
    that step less the roofline step at the GEMM efficiency.
    """
    model = ModelCost.from_model(get_preset(pub.model), pub.kv_format)
    gpu = get_gpu(pub.gpu)
    cached = round(pub.hit_rate * pub.context_tokens)
    new = pub.context_tokens - cached
    ideal = RooflineCostModel(
        model, gpu, fp8=fp8, expert_parallel=pub.prefill_expert_parallel, prefill_efficiency=1.0
    )
    per_gpu = pub.prefill_tokens_per_s / pub.gpus_per_node
    measured = pub.context_tokens / per_gpu
    flops_s = ideal._compute_s(
        new * model.linear_flops_per_token + model.lm_head_flops,
        model.prefill_attention_flops(cached, new),
        1.0,
    )
    step = 1.0 / pub.user_tokens_per_s
    batch = max(1, round(pub.decode_tokens_per_s / pub.gpus_per_node * step))
    roof = RooflineCostModel(model, gpu, fp8=fp8, expert_parallel=pub.decode_expert_parallel)
    overhead = step - roof.decode_step_time(batch, pub.context_tokens)
    return Calibration(flops_s / measured, max(0.0, overhead), pub.source, model.moe_layers)


@functools.cache
def hopper_calibration() -> Calibration:
    """`calibrate(DEEPSEEK_V3_SERVING)`: the Hopper presets' calibration (`hardware.calibration`
    `"hopper"`)."""
    return calibrate(DEEPSEEK_V3_SERVING)


# The calibrations `hardware.calibration` names (config.validate knows the same names).
CALIBRATIONS: dict[str, Callable[[], Calibration | None]] = {
    "hopper": hopper_calibration,
    "none": lambda: None,
}


# --------------------------------------------------------------------------- cost models of presets


def make_cost_model(
    hw: HardwareConfig,
    model: ModelConfig,
    *,
    fitted: FittedCostModel | None = None,
    weight_shards: int = 1,
    expert_parallel: int = 1,
    fp8: bool | None = None,
    calibration: Calibration | None = None,
    kv_format: str | None = None,
) -> CostModel:
    """The fitted model for "cpu"; for GPU presets the roofline of `hw.gpu`, calibrated.

    Arguments left at None come from `hw`: `calibration` from `hw.calibration` (`"hopper"`:
    `hopper_calibration()`, fitted to DeepSeek's published H800 serving; `"none"`: the bare
    roofline), `fp8` (FP8 weights and GEMMs) from `hw.fp8`, else DeepSeek-V3-family models
    (whose checkpoints are FP8; DeepSeek-V2's are BF16), `kv_format` from `hw.kv_format` (empty: the model's `kv_dtype`).
    `expert_parallel`: the GPUs routed experts are spread over."""
    if hw.gpu == "cpu":
        if fitted is None:
            raise ValueError("hardware gpu='cpu' needs a FittedCostModel (profile the engines)")
        return fitted
    if fp8 is None:
        fp8 = model.family == ModelFamily.DEEPSEEK if hw.fp8 is None else hw.fp8
    roof = RooflineCostModel(
        ModelCost.from_model(model, kv_format or hw.kv_format or None),
        get_gpu(hw.gpu),
        fp8=fp8,
        weight_shards=weight_shards,
        expert_parallel=expert_parallel,
    )
    if calibration is None:
        try:
            calibration = CALIBRATIONS[hw.calibration]()
        except KeyError:
            raise ValueError(
                f"unknown hardware.calibration {hw.calibration!r}; known: {sorted(CALIBRATIONS)}"
            ) from None
    return calibration.apply(roof) if calibration is not None else roof


def expert_parallel_gpus(cfg: ExperimentConfig) -> int:
    """The GPUs one expert-parallel group spreads the routed experts over: every GPU of
    `hardware.ep_decode_nodes` decode nodes (0: all decode nodes), the side that streams them
    every step; 1 for a dense model (no routed experts)."""
    if cfg.model.n_routed_experts <= 0:
        return 1
    hw = cfg.hardware
    return (hw.ep_decode_nodes or cfg.cluster.decode_nodes) * hw.engines_per_node


def config_cost_model(
    cfg: ExperimentConfig,
    *,
    fitted: FittedCostModel | None = None,
    kv_format: str | None = None,
) -> CostModel:
    """The cost model `cfg` names (`make_cost_model` of its hardware and model, routed experts
    over `expert_parallel_gpus(cfg)`): what `sim.simulate(cfg)` uses without `cost=`.
    `kv_format` (e.g. `SimOptions.kv_format`) overrides `hardware.kv_format`."""
    return make_cost_model(
        cfg.hardware,
        cfg.model,
        fitted=fitted,
        expert_parallel=expert_parallel_gpus(cfg),
        kv_format=kv_format,
    )


# --------------------------------------------------------------------------- sizing


def _gpt_oss(kv_format: str | None) -> ModelCost:
    c = ModelCost.from_model(GPT_OSS_120B, kv_format)
    return dataclasses.replace(
        c,
        full_attn_layers=c.num_layers - GPT_OSS_WINDOW_LAYERS,
        window_layers=GPT_OSS_WINDOW_LAYERS,
        window=GPT_OSS_WINDOW,
    )


def sizing_cost(name: str, kv_format: str | None = None) -> ModelCost:
    """`ModelCost` of a model preset (`PRESETS`) or a sizing-only preset (`SIZING_MODELS`)."""
    if name == GPT_OSS_120B.name:
        return _gpt_oss(kv_format)
    if name == QWEN3_235B_A22B.name:
        return ModelCost.from_model(QWEN3_235B_A22B, kv_format)
    if name in PRESETS:
        return ModelCost.from_model(PRESETS[name], kv_format)
    raise KeyError(f"unknown model {name!r}; known: {sorted({*PRESETS, *SIZING_MODELS})}")
