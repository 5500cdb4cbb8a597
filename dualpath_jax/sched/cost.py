"""Cost models: FLOPs and bytes of a model, a GPU roofline, a fitted CPU model.

`ModelCost` reduces a model to the counts every estimate needs (per token, per attention pair,
per cached token). Attention kinds:

- GQA (dense, Qwen2): `4 * H * head_dim` FLOPs per (query, key) pair per layer (QK^T and PV).
- MLA, absorbed (DeepSeek-V3): queries attend the latent directly, so a pair costs
  `2 * H * (kv_lora_rank + qk_rope_head_dim) + 2 * H * kv_lora_rank`.
- DeepSeek sparse attention (V3.2): the indexer scores every cached key
  (`2 * index_n_heads * index_head_dim` per pair), then each query attends only its top
  `index_topk` keys with MLA.
- Sliding-window layers (used by sizing presets) attend at most `window` keys.

Linear FLOPs are 2 x active parameters (MoE: routed top-k plus shared experts).

Prefill of dense MLA (DeepSeek-V3) uses the cheaper of the absorbed form and the MHA form, in
which each context token's latent is first expanded to per-head keys and values
(`2 * kv_lora_rank * H * (qk_nope + v)` FLOPs per context token per layer) and a pair then costs
`2 * H * (qk_nope + qk_rope) + 2 * H * v`; DSA models (V3.2) attend in the absorbed (MQA) form.

Cost models (`CostModel` protocol) answer three questions in seconds: `attention_time(pairs)`
(the predicted attention-layer time the compute quota bounds, all layers of one forward),
`prefill_time(pairs)` and `decode_step_time(batch, context)`, where `pairs` are the
`(cached, bsz)` pairs of one forward batch.

This module is the maths only. The GPUs (`GpuSpec` values), the calibration of the roofline to
published serving throughput and `make_cost_model`, which builds a cost model from a config's
hardware and model, are presets: `dualpath_jax.presets`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np

from dualpath_jax.config import HardwareConfig, ModelConfig, SchedulerConfig
from dualpath_jax.model.layout import kv_bytes_per_token_per_layer, np_dtype

# --------------------------------------------------------------------------- counting


def summed_keys(cached: int, bsz: int, limit: int = 0) -> float:
    """`sum_{j=1..bsz} min(cached + j, limit)`: keys seen by `bsz` causal queries after `cached`
    tokens, each capped at `limit` (0: no cap)."""
    if bsz <= 0:
        return 0.0
    if limit <= 0:
        return bsz * cached + bsz * (bsz + 1) / 2
    m = min(max(limit - cached, 0), bsz)
    return m * cached + m * (m + 1) / 2 + (bsz - m) * limit


@dataclasses.dataclass(frozen=True)
class ModelCost:
    """FLOP and byte counts of one model (all layers unless a name says per layer)."""

    name: str
    num_layers: int
    full_attn_layers: int  # layers that attend the whole context (or its top-k)
    pair_flops: float  # one (query, key) pair in one attention layer
    linear_flops_per_token: float  # every layer's projections and MLP/MoE, without the LM head
    lm_head_flops: float  # per token that gets logits (the last of each prompt, each decode step)
    kv_bytes_per_token_per_layer: float  # what one layer caches per token (stored, transferred)
    weight_bytes: float
    active_params: float  # per token, with the LM head, without the embedding lookup
    total_params: float
    window_layers: int = 0
    window: int = 0
    topk: int = 0  # DeepSeek sparse attention: keys per query (0: dense)
    index_pair_flops: float = 0.0  # DSA indexer, per (query, key) pair per layer
    index_bytes_per_token_per_layer: float = 0.0  # DSA indexer key cache
    routed_expert_params: float = (
        0.0  # MoE routed experts, all layers (what expert parallelism splits)
    )
    mha_pair_flops: float = 0.0  # dense MLA prefill in the MHA form (0: no such form)
    mha_context_flops: float = 0.0  # MHA form: expanding one context token's latent, per layer
    moe_layers: int = 0  # layers with routed experts (each an expert-parallel dispatch + combine)

    @classmethod
    def from_model(cls, cfg: ModelConfig, kv_format: str | None = None) -> ModelCost:
        """Counts for a `ModelConfig` (GQA, MLA, MoE and DSA fields); `kv_format` as in
        `model.layout.kv_bytes_per_token_per_layer` (e.g. "fp8_flashmla")."""
        h, d = cfg.hidden_size, cfg.num_heads
        if cfg.is_mla:
            qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
            q = (h * cfg.q_lora_rank + cfg.q_lora_rank * d * qk) if cfg.q_lora_rank else h * d * qk
            attn = (
                q
                + h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
                + cfg.kv_lora_rank * d * (cfg.qk_nope_head_dim + cfg.v_head_dim)
                + d * cfg.v_head_dim * h
            )
            pair = 2 * d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + 2 * d * cfg.kv_lora_rank
        else:
            hd = cfg.head_dim
            attn = 2 * h * d * hd + 2 * h * cfg.num_kv_heads * hd
            pair = 4 * d * hd
        index = 0
        if cfg.index_topk:
            q_in = cfg.q_lora_rank or h
            index = q_in * cfg.index_n_heads * cfg.index_head_dim + h * cfg.index_head_dim
            index += h * cfg.index_n_heads
        mha_pair = mha_context = 0
        if cfg.is_mla and not cfg.index_topk:
            mha_pair = (
                2 * d * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) + 2 * d * cfg.v_head_dim
            )
            mha_context = 2 * cfg.kv_lora_rank * d * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        dense_mlp = 3 * h * cfg.intermediate_size
        expert = 3 * h * cfg.moe_intermediate_size
        active = total = routed = 0.0
        for layer in range(cfg.num_layers):
            if cfg.is_moe_layer(layer):
                router = h * cfg.n_routed_experts
                active += (
                    attn
                    + index
                    + router
                    + (cfg.num_experts_per_tok + cfg.n_shared_experts) * expert
                )
                total += (
                    attn + index + router + (cfg.n_routed_experts + cfg.n_shared_experts) * expert
                )
                routed += cfg.n_routed_experts * expert
            else:
                active += attn + index + dense_mlp
                total += attn + index + dense_mlp
        head = cfg.vocab_size * h
        total += head * (1 if cfg.tie_embeddings else 2)
        return cls(
            name=cfg.name,
            num_layers=cfg.num_layers,
            full_attn_layers=cfg.num_layers,
            pair_flops=float(pair),
            linear_flops_per_token=2.0 * active,
            lm_head_flops=2.0 * head,
            kv_bytes_per_token_per_layer=float(kv_bytes_per_token_per_layer(cfg, kv_format)),
            weight_bytes=total * np_dtype(cfg.dtype).itemsize,
            active_params=active + head,
            total_params=total,
            topk=cfg.index_topk,
            index_pair_flops=float(2 * cfg.index_n_heads * cfg.index_head_dim),
            index_bytes_per_token_per_layer=float(cfg.index_head_dim + 4)
            if cfg.index_topk
            else 0.0,
            routed_expert_params=routed,
            mha_pair_flops=float(mha_pair),
            mha_context_flops=float(mha_context),
            moe_layers=sum(1 for layer in range(cfg.num_layers) if cfg.is_moe_layer(layer)),
        )

    def attention_flops(self, cached: int, bsz: int) -> float:
        """Attention-core FLOPs of `bsz` new tokens after `cached` ones, all layers."""
        full = self.pair_flops * summed_keys(cached, bsz, self.topk)
        if self.index_pair_flops and self.topk:
            full += self.index_pair_flops * summed_keys(cached, bsz)
        out = self.full_attn_layers * full
        if self.window_layers:
            out += self.window_layers * self.pair_flops * summed_keys(cached, bsz, self.window)
        return out

    def prefill_attention_flops(self, cached: int, bsz: int) -> float:
        """Attention FLOPs of a prefill chunk: the cheaper of the absorbed form and, for dense
        MLA, the MHA form (latent expansion of all `cached + bsz` tokens, then per-head pairs)."""
        absorbed = self.attention_flops(cached, bsz)
        if not self.mha_pair_flops or bsz <= 0:
            return absorbed
        mha = self.full_attn_layers * (
            self.mha_pair_flops * summed_keys(cached, bsz) + self.mha_context_flops * (cached + bsz)
        )
        return min(absorbed, mha)

    def kv_bytes(self, tokens: int) -> float:
        """Bytes of cached KV for a context of `tokens` (window layers keep at most `window`)."""
        out = self.full_attn_layers * self.kv_bytes_per_token_per_layer * tokens
        if self.window_layers:
            out += self.window_layers * self.kv_bytes_per_token_per_layer * min(tokens, self.window)
        return out

    def attended_kv_bytes(self, context: int) -> float:
        """KV bytes one decode query reads at `context` (DSA: top-k rows plus the index keys)."""
        if not self.topk:
            return self.kv_bytes(context)
        rows = self.full_attn_layers * self.kv_bytes_per_token_per_layer * min(context, self.topk)
        return rows + self.full_attn_layers * self.index_bytes_per_token_per_layer * context

    def prefill_flops(self, cached: int, bsz: int) -> float:
        """All FLOPs of prefilling `bsz` tokens after `cached` (logits for the last token only)."""
        if bsz <= 0:
            return 0.0
        return (
            bsz * self.linear_flops_per_token
            + self.prefill_attention_flops(cached, bsz)
            + self.lm_head_flops
        )

    def flops_per_new_token(self, context: int, append: int = 1) -> float:
        """Average FLOPs per appended token after `context` cached ones: 2 x active params plus
        attention (the Table 1 denominator)."""
        return 2.0 * self.active_params + self.attention_flops(context, append) / append


# --------------------------------------------------------------------------- cost models


class CostModel(Protocol):
    def attention_time(self, pairs: Sequence[tuple[int, int]]) -> float: ...

    def prefill_time(self, pairs: Sequence[tuple[int, int]]) -> float: ...

    def decode_step_time(self, batch: int, context: int) -> float: ...


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """Peak rates of one GPU and the fraction of them a good kernel reaches (the presets:
    `presets.GPU_PRESETS`)."""

    name: str
    bf16_flops: float
    fp8_flops: float
    hbm_bytes_per_s: float
    hbm_bytes: float
    flops_efficiency: float = 790 / 989.4  # measured dense BF16 GEMM on H200
    bw_efficiency: float = 4.3 / 4.8  # measured HBM copy bandwidth on H200


@dataclasses.dataclass(frozen=True)
class RooflineCostModel:
    """Time of one engine = one GPU; attention is data parallel (each engine serves its own
    requests) and the weights are shared as configured.

    - compute: linear FLOPs at the GEMM rate (FP8 when `fp8`) plus attention FLOPs at the BF16
      rate, times an efficiency (prefill: `prefill_efficiency`, decode: the GPU's GEMM
      efficiency; 0 means `gpu.flops_efficiency`);
    - memory: this GPU's weights plus the KV the forward reads, at the HBM rate;
    - a forward takes `max(compute, memory) + step_overhead_s`; a decode step also pays
      `decode_overhead_s` (expert-parallel all-to-all and pipeline bubbles that no roofline sees).

    Weights per GPU: `(dense + routed_experts / expert_parallel) / weight_shards` parameters at
    1 byte (`fp8`, DeepSeek's FP8 checkpoints) or the model dtype's size.
    """

    model: ModelCost
    gpu: GpuSpec
    fp8: bool = False
    weight_shards: int = 1
    step_overhead_s: float = 0.0
    expert_parallel: int = 1
    prefill_efficiency: float = 0.0
    decode_overhead_s: float = 0.0

    @property
    def flops_per_s(self) -> float:
        """Achieved linear-layer (GEMM) FLOP/s of a decode step."""
        return (self.gpu.fp8_flops if self.fp8 else self.gpu.bf16_flops) * self.gpu.flops_efficiency

    # Constants of a frozen model, asked for on every forward: computed once per instance.
    @functools.cached_property
    def bytes_per_s(self) -> float:
        return self.gpu.hbm_bytes_per_s * self.gpu.bw_efficiency

    @functools.cached_property
    def weight_bytes_per_gpu(self) -> float:
        m = self.model
        params = m.total_params - m.routed_expert_params * (1 - 1 / max(1, self.expert_parallel))
        per_param = 1.0 if self.fp8 else m.weight_bytes / max(m.total_params, 1.0)
        return params * per_param / max(1, self.weight_shards)

    def kv_hbm_bytes(self, reserve_fraction: float = 0.1) -> float:
        """HBM left for KV after the weights and a reserve for activations and workspace."""
        return max(0.0, self.gpu.hbm_bytes * (1 - reserve_fraction) - self.weight_bytes_per_gpu)

    def _compute_s(self, linear: float, attention: float, efficiency: float) -> float:
        gemm = self.gpu.fp8_flops if self.fp8 else self.gpu.bf16_flops
        eff = efficiency or self.gpu.flops_efficiency
        return (linear / gemm + attention / self.gpu.bf16_flops) / eff

    def attention_time(self, pairs: Sequence[tuple[int, int]]) -> float:
        m = self.model
        flops = sum(m.prefill_attention_flops(c, b) for c, b in pairs)
        nbytes = sum(m.kv_bytes(c + b) for c, b in pairs)
        return max(self._compute_s(0.0, flops, self.prefill_efficiency), nbytes / self.bytes_per_s)

    def attention_terms(self, cached: int, bsz: int) -> tuple[float, float]:
        """One pair's additive terms of `attention_time`: (FLOPs, KV bytes)."""
        m = self.model
        return m.prefill_attention_flops(cached, bsz), m.kv_bytes(cached + bsz)

    @functools.cached_property
    def _prefill_attention_rate(self) -> tuple[float, float]:
        """(BF16 FLOP/s, prefill efficiency): `_compute_s(0.0, flops, prefill_efficiency)` is
        `flops / rate / efficiency`, to the bit."""
        return self.gpu.bf16_flops, self.prefill_efficiency or self.gpu.flops_efficiency

    def attention_time_of(self, terms: Sequence[float]) -> float:
        """`attention_time` from the batch's summed `attention_terms`."""
        rate, eff = self._prefill_attention_rate
        return max(terms[0] / rate / eff, terms[1] / self.bytes_per_s)

    def prefill_time(self, pairs: Sequence[tuple[int, int]]) -> float:
        m = self.model
        live = [(c, b) for c, b in pairs if b > 0]
        linear = sum(b * m.linear_flops_per_token + m.lm_head_flops for _, b in live)
        attention = sum(m.prefill_attention_flops(c, b) for c, b in live)
        nbytes = self.weight_bytes_per_gpu + sum(m.kv_bytes(c + b) for c, b in pairs)
        compute = self._compute_s(linear, attention, self.prefill_efficiency)
        return max(compute, nbytes / self.bytes_per_s) + self.step_overhead_s

    def decode_step_time(self, batch: int, context: int) -> float:
        m = self.model
        linear = batch * (m.linear_flops_per_token + m.lm_head_flops)
        compute = self._compute_s(linear, batch * m.attention_flops(context, 1), 0.0)
        nbytes = self.weight_bytes_per_gpu + batch * m.attended_kv_bytes(context)
        return (
            max(compute, nbytes / self.bytes_per_s) + self.step_overhead_s + self.decode_overhead_s
        )

    def prefill_tokens_per_s(self, cached: int, new: int, batch: int = 1) -> float:
        """Prompt tokens (cached + new, as serving statistics count them) per second of
        back-to-back batches of `batch` requests `(cached, new)`."""
        return batch * (cached + new) / self.prefill_time([(cached, new)] * batch)


def nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients (active set; a handful of features)."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return coef


@dataclasses.dataclass(frozen=True)
class FittedCostModel:
    """Times fitted to measured samples of an engine (a PE fits its prefill model at start:
    `engines.calibrate`).

    prefill: `p0 + p1 * new_tokens + p2 * attention_pairs` per batch (pairs are causal
    query-key pairs, `summed_keys(cached, bsz)`); attention_time is the `p2` term.
    decode step: `d0 + d1 * batch + d2 * batch * context`.
    Serializable with `to_json` / `from_json` (`{"prefill": [p0, p1, p2], "decode": [d0, d1,
    d2]}`, seconds; `decode` may be left out: zeros).
    """

    prefill: tuple[float, float, float] = (0.0, 0.0, 0.0)
    decode: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @classmethod
    def fit(
        cls,
        prefill_samples: Iterable[tuple[int, int, float]],
        decode_samples: Iterable[tuple[int, int, float]] = (),
    ) -> FittedCostModel:
        """`prefill_samples`: `(cached, new, seconds)` of single-request forwards;
        `decode_samples`: `(batch, context, seconds)` of decode steps."""
        ps = list(prefill_samples)
        ds = list(decode_samples)
        prefill = decode = (0.0, 0.0, 0.0)
        if ps:
            x = np.array([[1.0, n, summed_keys(c, n)] for c, n, _ in ps])
            p0, p1, p2 = (float(v) for v in nnls(x, np.array([t for *_, t in ps])))
            prefill = (p0, p1, p2)
        if ds:
            x = np.array([[1.0, b, b * ctx] for b, ctx, _ in ds])
            d0, d1, d2 = (float(v) for v in nnls(x, np.array([t for *_, t in ds])))
            decode = (d0, d1, d2)
        return cls(prefill, decode)

    def attention_time(self, pairs: Sequence[tuple[int, int]]) -> float:
        return self.prefill[2] * sum(summed_keys(c, b) for c, b in pairs)

    def attention_terms(self, cached: int, bsz: int) -> tuple[float]:
        """One pair's additive term of `attention_time`: its query-key pairs."""
        return (summed_keys(cached, bsz),)

    def attention_time_of(self, terms: Sequence[float]) -> float:
        """`attention_time` from the batch's summed `attention_terms`."""
        return self.prefill[2] * terms[0]

    def prefill_time(self, pairs: Sequence[tuple[int, int]]) -> float:
        if not pairs:
            return 0.0
        p0, p1, p2 = self.prefill
        return p0 + sum(p1 * b + p2 * summed_keys(c, b) for c, b in pairs)

    def decode_step_time(self, batch: int, context: int) -> float:
        d0, d1, d2 = self.decode
        return d0 + d1 * batch + d2 * batch * context

    def to_json(self) -> str:
        return json.dumps({"prefill": list(self.prefill), "decode": list(self.decode)})

    @classmethod
    def from_json(cls, text: str) -> FittedCostModel:
        """Parses `to_json`'s text (other keys are ignored); ValueError unless `prefill` (and
        `decode`, when given) are three finite, non-negative numbers."""
        try:
            data: Any = json.loads(text)
            prefill = _coefficients(data["prefill"])
            decode = _coefficients(data.get("decode", [0.0, 0.0, 0.0]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not a FittedCostModel: {text[:80]!r} ({e})") from None
        return cls(prefill, decode)


def _coefficients(values: Any) -> tuple[float, float, float]:
    if not isinstance(values, list | tuple) or len(values) != 3:
        raise ValueError(f"expected 3 coefficients, got {values!r}")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        raise ValueError(f"coefficients must be numbers, got {values!r}")
    a, b, c = (float(v) for v in values)
    if not all(math.isfinite(v) and v >= 0 for v in (a, b, c)):
        raise ValueError(f"coefficients must be finite and >= 0, got {[a, b, c]}")
    return a, b, c


# --------------------------------------------------------------------------- alpha and beta


def derive_alpha(cfg: SchedulerConfig, hw: HardwareConfig, kv_bytes_per_token: float) -> float:
    """alpha: tokens one node's storage link reads in `alpha_s` (infinite if unlimited)."""
    if cfg.alpha_tokens > 0:
        return cfg.alpha_tokens
    if hw.snic_bytes_per_s <= 0:
        return math.inf
    return hw.snic_bytes_per_s * cfg.alpha_s / kv_bytes_per_token


def derive_beta(
    cfg: SchedulerConfig, cost: CostModel, *, ref_cached: int, ref_new: int, max_batch: int = 256
) -> float:
    """beta: tokens (counted like `tok_e`, i.e. prompt tokens) one engine prefills in `beta_s`,
    for batches of the reference request `(ref_cached, ref_new)` packed to the compute quota."""
    if cfg.beta_tokens > 0:
        return cfg.beta_tokens
    quota = cfg.compute_quota_ms / 1e3
    n = 1
    while n < max_batch and cost.attention_time([(ref_cached, ref_new)] * (n + 1)) <= quota:
        n += 1
    t = cost.prefill_time([(ref_cached, ref_new)] * n)
    if t <= 0:
        return math.inf
    return cfg.beta_s * n * (ref_cached + ref_new) / t


# The reference request beta is counted in for a cluster's engines: (cached, new) tokens.
BETA_REFERENCE = (512, 32)


def engines_beta(
    cfg: SchedulerConfig,
    costs: Iterable[CostModel],
    *,
    max_batch: int,
    reference: tuple[int, int] = BETA_REFERENCE,
) -> float:
    """beta of a cluster whose PEs have these cost models: the slowest PE's (the smallest
    `derive_beta`), so no PE is planned past what it prefills in `beta_s`. `beta_tokens` when
    set; with no model (no PE has reported one) infinite: no PE counts as overloaded."""
    if cfg.beta_tokens > 0:
        return cfg.beta_tokens
    betas = [
        derive_beta(cfg, c, ref_cached=reference[0], ref_new=reference[1], max_batch=max_batch)
        for c in costs
    ]
    return min(betas, default=math.inf)


def derive_alpha_beta(
    cfg: SchedulerConfig,
    hw: HardwareConfig,
    cost: CostModel,
    *,
    kv_bytes_per_token: float,
    ref_cached: int,
    ref_new: int,
) -> tuple[float, float]:
    """(alpha, beta) from the config, or derived when the config says 0."""
    return (
        derive_alpha(cfg, hw, kv_bytes_per_token),
        derive_beta(cfg, cost, ref_cached=ref_cached, ref_new=ref_new),
    )
