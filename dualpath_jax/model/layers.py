"""Building blocks of the model families: norms, attention, dense MLP and MoE (RoPE: rope.py).

Attention takes the layer's cached KV *rows* (`[B, C, W]`, see `layout.py`) explicitly and returns
the new tokens' KV rows, so a layer can run with KV that arrived from the host just before it.
GQA rows are head-major `[Hkv, K | V]`; MLA rows are `c_kv | k_pe` (the normalized latent and the
RoPE'd shared key), attended in the absorbed form: MLA is then multi-query attention with one KV
head whose key is the whole row and whose value is the latent. The attention itself (the paged
Pallas kernel, the dense path, the rows' layout and scales) is `dualpath_jax.kernels`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from dualpath_jax.config import ModelConfig
from dualpath_jax.kernels import paged_attention as pa
from dualpath_jax.kernels import paged_decode
from dualpath_jax.kernels.kv_rows import RowLayout, quantize_rows
from dualpath_jax.model import sharding
from dualpath_jax.model.layout import UnsupportedLayout
from dualpath_jax.model.moe import expert_ffn, resolve_moe_impl
from dualpath_jax.model.packing import Packing
from dualpath_jax.model.rope import Rope, apply_rope, yarn_mscale

Array = jax.Array


class Buffer(nnx.Variable):
    """A non-trainable array of a module (e.g. the MoE router's score-correction bias)."""


def _dtype(name: str) -> jnp.dtype:
    return jnp.dtype(name)


def _init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: jnp.dtype, fan_in: int) -> Array:
    """Random normal weights with variance 1 / fan_in (keeps tiny models' logits well separated)."""
    return (fan_in**-0.5 * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


class Linear(nnx.Module):
    """`y = x @ kernel (+ bias)` with kernel `[in, out]` (the transpose of a torch weight)."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.kernel = nnx.Param(_init(rngs, (d_in, d_out), dtype, d_in))
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None

    def __call__(self, x: Array) -> Array:
        # Accumulate in f32 and round once (what a bf16 matmul does on GPU and TPU); asking for
        # it also keeps XLA:CPU from materializing an f32 copy of every bf16 weight.
        y = jnp.dot(x, self.kernel[...], preferred_element_type=jnp.float32).astype(x.dtype)
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * y).astype(x.dtype)


# Attention backends (`ModelConfig.attention_impl`); "auto" resolves to one of these.
ATTENTION_IMPLS = ("reference", "xla", "pallas")


# What "auto" runs on each platform (`jax.default_backend()` names).
_AUTO_IMPL = {
    "gpu": "pallas",
    "cuda": "pallas",
    "rocm": "pallas",
    "tpu": "pallas",
    "cpu": "reference",
}


def resolve_attention_impl(name: str, platform: str | None = None) -> str:
    """The backend `name` runs on `platform` (default: the one JAX finds; no device of that
    platform is needed): itself, or for "auto" the paged kernel (`pallas`:
    `kernels/paged_attention.py`, Pallas-Triton on GPU, its Mosaic form on TPU) on
    accelerators, which reads only a request's live pages and materializes nothing of size
    `[queries, keys]`; `reference` on CPU (fast to compile, the tested oracle; the kernel would
    run interpreted there)."""
    if name == "auto":
        platform = (platform or jax.default_backend()).lower()
        if platform not in _AUTO_IMPL:
            raise ValueError(f"unknown platform {platform!r}: one of {sorted(_AUTO_IMPL)}")
        return _AUTO_IMPL[platform]
    if name not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl must be 'auto' or one of {ATTENTION_IMPLS}, got {name!r}")
    return name


@dataclasses.dataclass(frozen=True)
class PagedKV:
    """One layer's cached KV in pages: `pages` `[P, L, page_size, W]` (KV rows, or their bits
    as unsigned integers: `kv_rows.bits_dtype`), `table` `[B, M]` page ids per request,
    `lens` `[B]` cached tokens per request, `layer` the layer of `pages` to read. With `write`
    `[B]`, attention also writes request b's first `write[b]` new rows into its pages (decode).
    With `new_lens` `[B]` request b has that many real new tokens and the rest are padding,
    whose attention output is zero (the kernel skips it: a ragged batch)."""

    pages: Array
    table: Array
    lens: Array
    layer: Array | int = 0
    write: Array | None = None
    new_lens: Array | None = None

    @classmethod
    def contiguous(cls, rows: Array, lens: Array) -> PagedKV:
        """Contiguous cached rows `[B, C, W]` as pages (a reshape: identity page tables)."""
        b, c, w = rows.shape
        if c == 0:
            return cls(jnp.zeros((1, 1, 1, w), rows.dtype), jnp.zeros((b, 1), jnp.int32), lens)
        ps = math.gcd(c, 64)
        m = c // ps
        table = jnp.arange(b * m, dtype=jnp.int32).reshape(b, m)
        return cls(rows.reshape(b * m, 1, ps, w), table, lens)


def attend_kv(
    q: Array, new_rows: Array, kv: PagedKV, layout, scale: float, kv_dtype, impl: str,
    pages_per_step: int | None = None,
) -> tuple[Array, Array | None]:  # fmt: skip
    """Attention of the new tokens (queries `q` `[B, N, Hq, dk]`, their rows `new_rows`
    `[B, N, W]`) over their cached KV `kv` and themselves, causally, with backend `impl`:
    `pallas` runs the paged kernel over the live pages only; `reference`/`xla` gather the pages
    into contiguous rows and attend densely (the oracle). Returns (output `[B, N, Hq, dv]`, the
    pages with the new rows written if `kv.write` is set, else None). `pages_per_step`: the
    kernel's cached pages per step (None: its default)."""
    args = (q, kv.pages, kv.table, kv.lens, new_rows, layout, scale)
    if impl == "pallas":
        return _paged_kernel(q, new_rows, kv, layout, scale, kv_dtype, pages_per_step)
    dense = functools.partial(
        pa.paged_attention_reference, layer=kv.layer, kv_dtype=kv_dtype, new_lens=kv.new_lens,
        impl=impl,
    )  # fmt: skip
    if kv.write is None:
        return dense(*args), None
    # Write first, then read the written pages (the rows past `lens` are masked anyway): the
    # pool then has one reader-writer chain, which XLA updates in place inside a layer scan.
    pages = pa.write_pages(kv.pages, kv.table, kv.lens, new_rows, kv.write, kv.layer)
    pages = sharding.constrain_kv(pages, layout)  # the pool stays split by KV head
    if q.shape[1] == 1:  # a decode step: its row is in the pages now
        decode = (
            paged_decode.paged_decode_chunked  # a few pages at a time
            if impl == "reference"
            else functools.partial(paged_decode.paged_decode_reference, impl=impl)
        )
        out = decode(
            q, pages, kv.table, kv.lens, layout, scale, layer=kv.layer, kv_dtype=kv_dtype,
            written=kv.write,
        )  # fmt: skip
        if kv.new_lens is not None:
            out = jnp.where((kv.new_lens > 0)[:, None, None, None], out, 0).astype(out.dtype)
        return out, pages
    return dense(q, pages, *args[2:]), pages


def _paged_kernel(q, new_rows, kv: PagedKV, layout: RowLayout, scale, kv_dtype, pages_per_step):
    """The paged kernel, under `shard_map` when a mesh is set: each device attends with its
    share of the heads, so no step gathers the page pool. Over `tensor`: GQA's pages, new rows
    and queries split by KV head (a device's rows are its KV heads with their fp8 scales, a
    layout of `Hk / tensor` heads); MLA's latent (one KV head) replicated and the query heads
    split; head counts the axis does not divide are not split by head. Over `data`: the
    requests of a batch that writes nothing; a decode step that writes its pages runs every
    request on each `data` shard (its pool is replicated over `data`: each writes all of it)."""

    def call(q, pages, table, lens, new, layer, write, new_lens, layout):
        return pa.paged_attention(
            q, pages, table, lens, new, layout, scale, layer=layer, kv_dtype=kv_dtype,
            write_lens=write, new_lens=new_lens, pages_per_compute_block=pages_per_step,
        )  # fmt: skip

    layer = jnp.asarray(kv.layer, jnp.int32)
    new_lens = jnp.full(q.shape[:1], q.shape[1], jnp.int32) if kv.new_lens is None else kv.new_lens
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        out = call(q, kv.pages, kv.table, kv.lens, new_rows, layer, kv.write, new_lens, layout)
        return out if kv.write is not None else (out, None)
    t, d = sharding.axis_size("tensor"), sharding.axis_size("data")
    b, hq, hk = q.shape[0], q.shape[2], layout.num_kv_heads
    heads = kv_axis = None
    local = layout
    if t > 1 and hq % t == 0 and hk % t == 0:
        heads = kv_axis = "tensor"
        local = layout.with_heads(hk // t)
    elif t > 1 and hq % t == 0 and hk == 1:  # MLA: the latent every query head reads
        heads = "tensor"
    batch = "data" if kv.write is None and d > 1 and b % d == 0 else None
    writing = kv.write is not None
    in_specs = (
        P(batch, None, heads, None),
        P(None, None, None, kv_axis),
        P(batch, None),
        P(batch),
        P(batch, None, kv_axis),
        P(),
        P(batch) if writing else None,
        P(batch),
    )
    out_specs = (P(batch, None, heads, None), P(None, None, None, kv_axis))
    fn = jax.shard_map(
        functools.partial(call, layout=local),
        in_specs=in_specs,
        out_specs=out_specs if writing else out_specs[0],
        check_vma=False,
    )
    out = fn(q, kv.pages, kv.table, kv.lens, new_rows, layer, kv.write, new_lens)
    return out if writing else (out, None)


def _kv_rows(rows: Array, layout: RowLayout, kv_dtype) -> Array:
    """A layer's new KV rows in the cache's format: cast to `kv_dtype`, or quantized with
    per-token scales appended where the layout is scaled (`ModelConfig.kv_scales`)."""
    if layout.scaled:
        return quantize_rows(rows, layout, kv_dtype)
    return rows.astype(kv_dtype)


class GQAttention(nnx.Module):
    """Qwen attention: GQA with rotate-half RoPE, QKV bias (Qwen2) or RMSNorm over each query
    and key head before RoPE (`qk_norm`, Qwen3). KV row = `[Hkv, K | V]` (head-major)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = _dtype(cfg.dtype)
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias, dtype=dt, rngs=rngs)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias, dtype=dt, rngs=rngs)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias, dtype=dt, rngs=rngs)
        self.o_proj = Linear(cfg.num_heads * d, h, bias=False, dtype=dt, rngs=rngs)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dt)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dt)
        else:
            self.q_norm = self.k_norm = None
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.rope = Rope.for_model(cfg, d)
        self.kv_dtype = _dtype(cfg.kv_dtype)
        self.layout = RowLayout.for_model(cfg)
        self.attention_impl = resolve_attention_impl(cfg.attention_impl)
        self.pages_per_step = cfg.attention_pages_per_step or None

    def project(self, x: Array, positions: Array) -> tuple[Array, Array]:
        """x `[B, N, hidden]` -> (queries `[B, N, Hq, D]`, new KV rows `[B, N, W]`)."""
        b, n, _ = x.shape
        q = self.q_proj(x).reshape(b, n, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.rope.angles(positions)
        q = apply_rope(q, cos, sin, interleave=False)
        k = apply_rope(k, cos, sin, interleave=False)
        rows = jnp.concatenate([k, v], axis=-1).reshape(b, n, -1)  # head-major: [Hkv, K | V]
        rows = _kv_rows(rows, self.layout, self.kv_dtype)
        return q, sharding.constrain_kv(rows, self.layout, "batch")

    def attend(self, q: Array, new_rows: Array, kv: PagedKV) -> tuple[Array, Array | None]:
        """q `[B, N, Hq, D]`, the new rows `[B, N, W]`, the cached KV -> (output
        `[B, N, hidden]`, the written pages or None: `attend_kv`)."""
        out, pages = self.attend_heads(q, new_rows, kv)
        return self.output(out), pages

    def attend_heads(self, q: Array, new_rows: Array, kv: PagedKV) -> tuple[Array, Array | None]:
        """`attend` up to each head's output `[B, N, Hq, D]` (what `output` projects)."""
        return attend_kv(
            q, new_rows, kv, self.layout, self.head_dim**-0.5, self.kv_dtype, self.attention_impl,
            self.pages_per_step,
        )  # fmt: skip

    def output(self, out: Array) -> Array:
        return self.o_proj(out.reshape(*out.shape[:2], -1))


class MLAttention(nnx.Module):
    """DeepSeek multi-head latent attention, absorbed form. KV row = c_kv (normalized) | k_pe."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = _dtype(cfg.dtype)
        h, nh = cfg.hidden_size, cfg.num_heads
        self.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, bias=False, dtype=dt, rngs=rngs)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, dt)
            self.q_b_proj = Linear(
                cfg.q_lora_rank, nh * self.qk_head_dim, bias=False, dtype=dt, rngs=rngs
            )
            self.q_proj = None
        else:
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
            self.q_proj = Linear(h, nh * self.qk_head_dim, bias=False, dtype=dt, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(
            h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False, dtype=dt, rngs=rngs
        )
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6, dt)
        # kv_b_proj split per head into the key (W_UK) and value (W_UV) up-projections.
        self.w_uk = nnx.Param(
            _init(rngs, (cfg.kv_lora_rank, nh, cfg.qk_nope_head_dim), dt, cfg.kv_lora_rank)
        )
        self.w_uv = nnx.Param(
            _init(rngs, (cfg.kv_lora_rank, nh, cfg.v_head_dim), dt, cfg.kv_lora_rank)
        )
        self.o_proj = Linear(nh * cfg.v_head_dim, h, bias=False, dtype=dt, rngs=rngs)
        self.num_heads = nh
        self.kv_lora_rank, self.nope = cfg.kv_lora_rank, cfg.qk_nope_head_dim
        self.rope, self.interleave = Rope.for_model(cfg, cfg.qk_rope_head_dim), cfg.rope_interleave
        self.scale = self.qk_head_dim**-0.5
        if cfg.rope_type == "yarn" and cfg.rope_mscale_all_dim:
            # DeepSeek's yarn also sharpens the softmax: by mscale(factor, mscale_all_dim)^2.
            self.scale *= yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2
        self.kv_dtype = _dtype(cfg.kv_dtype)
        self.layout = RowLayout.for_model(cfg)
        self.attention_impl = resolve_attention_impl(cfg.attention_impl)
        self.pages_per_step = cfg.attention_pages_per_step or None

    def project(self, x: Array, positions: Array) -> tuple[Array, Array]:
        """x `[B, N, hidden]` -> (absorbed queries `[B, N, H, r + dr]`, new KV rows `[B, N, r + dr]`)."""
        b, n, _ = x.shape
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(b, n, self.num_heads, self.qk_head_dim)
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :]
        ckv = self.kv_a_proj_with_mqa(x)
        c, k_pe = ckv[..., : self.kv_lora_rank], ckv[..., self.kv_lora_rank :]
        c = self.kv_a_layernorm(c)
        cos, sin = self.rope.angles(positions)
        q_pe = apply_rope(q_pe, cos, sin, self.interleave)
        k_pe = apply_rope(k_pe[:, :, None, :], cos, sin, self.interleave)[:, :, 0, :]
        q_lat = jnp.einsum(
            "bnhd,rhd->bnhr", q_nope, self.w_uk[...], preferred_element_type=jnp.float32
        ).astype(q_nope.dtype)
        rows = _kv_rows(jnp.concatenate([c, k_pe], axis=-1), self.layout, self.kv_dtype)
        return jnp.concatenate([q_lat, q_pe], axis=-1), rows

    def attend(self, q: Array, new_rows: Array, kv: PagedKV) -> tuple[Array, Array | None]:
        """Absorbed queries, the new rows `[B, N, r + dr]`, the cached KV -> (output
        `[B, N, hidden]`, the written pages or None: `attend_kv`)."""
        o_lat, pages = self.attend_heads(q, new_rows, kv)
        return self.output(o_lat), pages

    def attend_heads(self, q: Array, new_rows: Array, kv: PagedKV) -> tuple[Array, Array | None]:
        """`attend` up to each head's latent output `[B, N, H, r]` (what `output` projects)."""
        return attend_kv(
            q, new_rows, kv, self.layout, self.scale, self.kv_dtype, self.attention_impl,
            self.pages_per_step,
        )  # fmt: skip

    def output(self, o_lat: Array) -> Array:
        out = jnp.einsum(
            "bnhr,rhd->bnhd", o_lat, self.w_uv[...], preferred_element_type=jnp.float32
        ).astype(o_lat.dtype)
        return self.o_proj(out.reshape(*out.shape[:2], -1))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear(hidden, inter, bias=False, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(hidden, inter, bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(inter, hidden, bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x: Array) -> Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nnx.Module):
    """Routed SwiGLU experts (grouped matmul over tokens sorted by expert, `moe.expert_ffn` with
    `cfg.moe_impl`) plus shared experts. The router scores experts by sigmoid or softmax and
    picks them greedily or within the best expert groups (`ModelConfig.topk_method`): DeepSeek-V3
    (sigmoid, score-correction bias, groups ranked by their best two), DeepSeek-V2 (softmax,
    groups ranked by their best) and Qwen3-MoE (softmax, greedy, no shared experts)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = _dtype(cfg.dtype)
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.router = nnx.Param(_init(rngs, (e, h), jnp.float32, h))
        self.e_score_correction_bias = (
            Buffer(jnp.zeros((e,), jnp.float32)) if cfg.topk_method == "noaux_tc" else None
        )
        self.w_gate = nnx.Param(_init(rngs, (e, h, i), dt, h))
        self.w_up = nnx.Param(_init(rngs, (e, h, i), dt, h))
        self.w_down = nnx.Param(_init(rngs, (e, i, h), dt, i))
        self.shared = MLP(h, i * cfg.n_shared_experts, dt, rngs) if cfg.n_shared_experts else None
        self.top_k, self.n_group, self.topk_group = (
            cfg.num_experts_per_tok,
            cfg.n_group,
            cfg.topk_group,
        )
        self.scoring, self.topk_method = cfg.moe_scoring, cfg.topk_method
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.moe_impl = resolve_moe_impl(cfg.moe_impl)

    def route(self, x: Array) -> tuple[Array, Array]:
        """x `[T, hidden]` -> (weights `[T, k]` float32, expert ids `[T, k]`)."""
        logits = jnp.dot(x.astype(jnp.float32), self.router[...].T)
        if self.scoring == "softmax":
            scores = jax.nn.softmax(logits, axis=-1)
        else:
            scores = jax.nn.sigmoid(logits)
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = scores + self.e_score_correction_bias[...]
        if self.topk_method != "greedy":
            choice = self._best_groups_only(choice)
        _, ids = jax.lax.top_k(choice, self.top_k)
        w = jnp.take_along_axis(scores, ids, axis=1)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdims=True) + 1e-20)
        return w * self.scaling, ids

    def _best_groups_only(self, choice: Array) -> Array:
        """`choice` `[T, E]` with the experts outside each token's `topk_group` best groups at
        -inf. A group's score is its best expert's ("group_limited_greedy") or the sum of its
        best two ("noaux_tc")."""
        t, e = choice.shape
        grouped = choice.reshape(t, self.n_group, e // self.n_group)
        if self.topk_method == "noaux_tc":
            group_scores = jax.lax.top_k(grouped, min(2, e // self.n_group))[0].sum(-1)
        else:
            group_scores = grouped.max(-1)
        _, top_groups = jax.lax.top_k(group_scores, self.topk_group)
        keep = jnp.zeros((t, self.n_group), bool).at[jnp.arange(t)[:, None], top_groups].set(True)
        return jnp.where(jnp.repeat(keep, e // self.n_group, axis=1), choice, -jnp.inf)

    def __call__(self, x: Array) -> Array:
        shape = x.shape
        xt = x.reshape(-1, shape[-1])  # [T, hidden]
        w, ids = self.route(xt)
        weights = (self.w_gate[...], self.w_up[...], self.w_down[...])
        ep = sharding.axis_size("expert")
        if ep > 1 and self.w_gate.shape[0] % ep == 0:
            # Expert parallelism: each shard of the `expert` axis holds E / ep experts and runs
            # them over the rows routed to them (every shard sees every token), then the
            # shards' outputs are summed. Other mesh axes stay automatic.
            run = jax.shard_map(
                functools.partial(self._experts, ep=ep),
                in_specs=(P(), P(), P(), P("expert"), P("expert"), P("expert")),
                out_specs=P(),
                axis_names={"expert"},
                check_vma=False,
            )
            out = run(xt, w, ids, *weights)
        else:
            out = self._experts(xt, w, ids, *weights, ep=1)
        out = out.astype(x.dtype)
        if self.shared is not None:
            out = out + self.shared(xt)
        return out.reshape(shape)

    def _experts(self, xt, w, ids, w_gate, w_up, w_down, *, ep: int) -> Array:
        """The routed experts `w_*` `[E_local, ...]` (with `ep > 1`: shard
        `axis_index("expert")` of the experts) over the tokens xt `[T, hidden]` routed to them
        (ids, weights `[T, k]`) -> float32 `[T, hidden]`, summed over the expert shards. Rows
        routed to other shards' experts sort after the local groups, where `expert_ffn`
        leaves zeros."""
        t, k = ids.shape
        n_local = w_gate.shape[0]
        first = jax.lax.axis_index("expert") * n_local if ep > 1 else 0
        local = ids.reshape(-1) - first
        mine = (local >= 0) & (local < n_local)
        key = jnp.where(mine, local, n_local)
        order = jnp.argsort(key, stable=True)
        token_of = order // k
        xs = xt[token_of]  # [T*k, hidden], sorted by expert
        sizes = jnp.bincount(key, length=n_local + 1)[:n_local].astype(jnp.int32)
        ys = expert_ffn(xs, sizes, w_gate, w_up, w_down, self.moe_impl)
        gate = jnp.where(mine, w.reshape(-1), 0.0)[order]
        ys = ys.astype(jnp.float32) * gate[:, None]
        out = jnp.zeros((t, xt.shape[-1]), jnp.float32).at[token_of].add(ys)
        return jax.lax.psum(out, "expert") if ep > 1 else out


class DecoderLayer(nnx.Module):
    """Pre-norm decoder layer. `__call__` runs the layer for new tokens given the cached KV rows."""

    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
        if cfg.is_window_layer(layer):
            # The layout names the window (a "last W tokens" group); the attention here and the
            # kernels under it (kernels/paged_attention*.py) attend over every cached token.
            raise UnsupportedLayout(
                f"layer {layer} of {cfg.name!r} attends over the last {cfg.sliding_window} tokens"
                " (sliding window): the model forward and its attention kernels attend over"
                " every cached token, so sliding-window layers are not supported yet"
            )
        dt = _dtype(cfg.dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.self_attn = MLAttention(cfg, rngs) if cfg.is_mla else GQAttention(cfg, rngs)
        if cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg, rngs)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dt, rngs)

    def __call__(
        self,
        h: Array,
        positions: Array,
        cached: Array | PagedKV,
        cached_lens: Array | None = None,
        new_lens: Array | None = None,
        packing: Packing | None = None,
    ) -> tuple[Array, Array]:
        """h `[B, N, hidden]`, positions `[B, N]`, the cached KV (`PagedKV`, or contiguous rows
        `[B, C, W]` with `cached_lens` `[B]`), optionally the real new tokens `new_lens` `[B]`
        (see `PagedKV`) -> (h `[B, N, hidden]`, new KV rows `[B, N, W]`). New token j of
        request b sees its cached tokens and new tokens 0..j. With `packing` (packing.py) h and
        positions are the batch's tokens packed, `[1, T, ...]`; the new rows are padded."""
        if not isinstance(cached, PagedKV):
            cached = PagedKV.contiguous(cached, cached_lens)
        if new_lens is not None:
            cached = dataclasses.replace(cached, new_lens=new_lens)
        h, new_rows, _ = self.run(h, positions, dataclasses.replace(cached, write=None), packing)
        return h, new_rows

    def run(
        self, h: Array, positions: Array, kv: PagedKV, packing: Packing | None = None
    ) -> tuple[Array, Array, Array | None]:
        """The layer over paged KV -> (h, new KV rows, the pages with the new rows written when
        `kv.write` is set, else None); see `__call__` for `packing`."""
        h = sharding.constrain(h, "batch")  # replicated over tensor between layers
        q, new_rows = self.self_attn.project(self.input_layernorm(h), positions)
        if packing is not None:  # attention over the padded layout
            q, new_rows = packing.pad(q), packing.pad(new_rows)
        out, pages = self.self_attn.attend_heads(q, new_rows, kv)
        if packing is not None:
            out = packing.pack(out)
        h = h + self.self_attn.output(out)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return sharding.constrain(h, "batch"), new_rows, pages
