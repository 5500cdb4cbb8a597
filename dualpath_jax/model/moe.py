"""The routed experts' grouped FFN of the MoE layer (`ModelConfig.moe_impl`).

`expert_ffn(xs, sizes, w_gate, w_up, w_down, impl)` runs routed SwiGLU experts over rows sorted
by expert: xs `[N, hidden]` (N = tokens x top-k), sizes `[E]` int32 (row counts per expert, in
order; they sum to N), w_gate / w_up `[E, hidden, inter]`, w_down `[E, inter, hidden]` ->
`[N, hidden]` in xs's dtype. Every implementation computes the same rows:

- `ragged_dot`: three `jax.lax.ragged_dot` calls. The oracle. XLA:CPU, and GPU with this
  jaxlib, lower it to a dense matmul over every expert, zero-padded: `[N, E, ...]`-sized work and
  scratch (154 GiB at 2,048 DeepSeek-V3 tokens on CPU; `bench/moe_memory.py`).
- `grouped`: megablox-style tiling in plain JAX. Each expert's rows are padded up to a multiple
  of a tile of m rows, so every tile belongs to exactly one expert; a `lax.scan` over the tiles
  multiplies each by its expert's weights (a dynamic index, not a gathered `[tiles, hidden,
  inter]` copy). The padded row count has a static bound, N + min(E, N) * (m - 1), so the
  program's shapes and memory are fixed by N, E and m alone and no routing can overflow it:
  exact, never drops a row. A per-expert capacity `[E, C, hidden]` was rejected: C is static but
  must cover the largest group, which the router can make N, and that is the dense case again.
  The cost of the bound is up to E * (m - 1) padding rows of compute (trailing tiles past the
  real ones run too; they are masked), which is why m shrinks with N / E (`tile_rows`).
- `gmm`: the Pallas megablox grouped GEMM (`jax.experimental.pallas.ops.tpu.megablox.gmm`),
  compiled on TPU. Elsewhere it runs in Pallas interpret mode, which is exact but slow: a
  correctness path for tests, never what `auto` picks off TPU.

`auto` (`resolve_moe_impl`) picks `gmm` on TPU, `grouped` on GPU and `ragged_dot` on CPU, where
the project only runs tiny models and `ragged_dot` is the tested oracle (on the tiny preset's
8 experts `grouped` is as fast at 4 tokens and about 1.6-2x faster at 64-512 tokens on CPU, and
gives the same greedy tokens; the oracle stays the default so the CPU suite runs the path every
other implementation is checked against).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

# Routed-expert FFN implementations (`ModelConfig.moe_impl`); "auto" resolves to one of these.
MOE_IMPLS = ("ragged_dot", "grouped", "gmm")

_GMM_TILE = 128  # megablox's default (m, k, n) tile; smaller where the operand is smaller


def resolve_moe_impl(name: str) -> str:
    """The implementation `name` runs: itself, or for "auto" the best one for the platform JAX
    finds (`gmm` on TPU, `grouped` on GPU, `ragged_dot` on CPU)."""
    if name == "auto":
        return {"tpu": "gmm", "gpu": "grouped"}.get(jax.default_backend(), "ragged_dot")
    if name not in MOE_IMPLS:
        raise ValueError(f"moe_impl must be 'auto' or one of {MOE_IMPLS}, got {name!r}")
    return name


def expert_ffn(
    xs: Array, sizes: Array, w_gate: Array, w_up: Array, w_down: Array, impl: str
) -> Array:
    """Routed SwiGLU experts over rows sorted by expert (shapes in the module docstring).
    `impl` is a resolved name (one of `MOE_IMPLS`)."""
    if impl == "ragged_dot":
        return _ragged_dot(xs, sizes, w_gate, w_up, w_down)
    if impl == "grouped":
        return grouped(xs, sizes, w_gate, w_up, w_down)
    if impl == "gmm":
        return _gmm(xs, sizes, w_gate, w_up, w_down)
    raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {impl!r}")


def _ragged_dot(xs: Array, sizes: Array, w_gate: Array, w_up: Array, w_down: Array) -> Array:
    gate = jax.lax.ragged_dot(xs, w_gate, sizes)
    up = jax.lax.ragged_dot(xs, w_up, sizes)
    return jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, sizes)


def tile_rows(n_rows: int, n_experts: int) -> int:
    """The `grouped` tile m: the power of two at or above the mean group size N / E, within
    [8, 128]. Small batches (decode) then pad each expert by at most 7 rows rather than 127;
    large ones get tiles big enough to keep the matmuls efficient."""
    mean = -(-n_rows // max(n_experts, 1))
    return min(128, max(8, 1 << (mean - 1).bit_length()))


def grouped(
    xs: Array,
    sizes: Array,
    w_gate: Array,
    w_up: Array,
    w_down: Array,
    tile: int | None = None,
) -> Array:
    """The `grouped` implementation; `tile` rows per tile (default `tile_rows(N, E)`)."""
    n, hidden = xs.shape
    e = w_gate.shape[0]
    m = tile or tile_rows(n, e)
    n_tiles = max(1, (n + min(e, n) * (m - 1)) // m)  # static bound on the padded tiles
    sizes = sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    tiles_of = (sizes + m - 1) // m  # [E]
    tile_ends = jnp.cumsum(tiles_of)
    tile_starts = tile_ends - tiles_of
    # The expert of each tile; tiles past the real ones get the last expert and are masked.
    tile_expert = jnp.minimum(
        jnp.searchsorted(tile_ends, jnp.arange(n_tiles), side="right"), e - 1
    ).astype(jnp.int32)  # [n_tiles]
    # Padded row p = (tile t, row j of the tile) holds row starts[e] + (t - tile_starts[e]) * m + j
    # of expert e = tile_expert[t], if that lies inside e's group.
    within = (jnp.arange(n_tiles) - tile_starts[tile_expert])[:, None] * m + jnp.arange(m)
    real = within < sizes[tile_expert][:, None]  # [n_tiles, m]
    src = jnp.where(real, starts[tile_expert][:, None] + within, 0)
    xp = jnp.where(real[..., None], xs[src], 0)  # [n_tiles, m, hidden]

    def one_tile(_, tile_in):
        x, ex = tile_in  # [m, hidden], expert id
        gate = jnp.dot(x, w_gate[ex])
        up = jnp.dot(x, w_up[ex])
        return None, jnp.dot(jax.nn.silu(gate) * up, w_down[ex])

    _, yp = jax.lax.scan(one_tile, None, (xp, tile_expert))  # [n_tiles, m, hidden]
    # Back to the sorted rows: row r of expert g sits at tile tile_starts[g] + (r - starts[g]) // m.
    rows = jnp.arange(n)
    g = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), e - 1)
    off = rows - starts[g]
    ys = yp.reshape(n_tiles * m, hidden)[tile_starts[g] * m + off]
    return jnp.where((rows < ends[-1])[:, None], ys, 0).astype(xs.dtype)


def _gmm(xs: Array, sizes: Array, w_gate: Array, w_up: Array, w_down: Array) -> Array:
    try:
        from jax.experimental.pallas.ops.tpu.megablox import gmm
    except ImportError as err:  # a jax without Pallas' TPU ops
        raise ValueError(
            f"moe_impl 'gmm' needs Pallas megablox, which fails to import: {err}"
        ) from err
    n, _ = xs.shape
    interpret = jax.default_backend() != "tpu"
    # megablox takes whole m tiles: pad the rows to one, the padding counted in the last group
    # (zero rows, sliced off), and rows past sum(sizes) masked after, as ragged_dot leaves them.
    tm = min(_GMM_TILE, max(16, 1 << (n - 1).bit_length()))
    pad = -n % tm
    xp = jnp.pad(xs, ((0, pad), (0, 0)))
    sz = sizes.astype(jnp.int32).at[-1].add(pad + n - sizes.sum(dtype=jnp.int32))

    def mm(x: Array, w: Array) -> Array:
        tiling = (tm, min(_GMM_TILE, w.shape[1]), min(_GMM_TILE, w.shape[2]))
        return gmm(x, w, sz, preferred_element_type=xs.dtype, tiling=tiling, interpret=interpret)

    ys = mm(jax.nn.silu(mm(xp, w_gate)) * mm(xp, w_up), w_down)[:n]
    return jnp.where((jnp.arange(n) < sizes.sum())[:, None], ys, 0)
