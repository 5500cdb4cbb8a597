"""The online softmax both forms of the paged kernel run (`paged_attention.py` for GPU and
interpret mode, `paged_attention_tpu.py` for TPU): scores of a block of keys against a program's
query rows, and the running (accumulators, max, sum) updated block by block, all in f32.

A key block arrives as `load(offset, width, scale index)`, which gives one segment of the keys'
rows in the compute dtype (the kernels differ in where rows come from and how scales are read).
Running maxima and sums are `[rows, 1]` (two-dimensional, as TPU vector layouts want).

Around it, what both forms share outside the program: their first operands
(`scalar_operands`), the arrays their programs write (`out_shapes`: the output, or split-KV's
partials) and the combine of those partials after the call (`combine`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

Array = jax.Array

NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # a masked score (finite: no inf - inf)

Segment = tuple  # (offset, width, scale index or None)
Load = Callable[[int, int, object], Array]


def broadcast_dot(a: Array, b: Array, contract_b: int) -> Array:
    """`a [m, k]` times `b` contracted over b's axis `contract_b` in f32, without a matmul: for
    blocks too small for one (a single new key in decode). One key keeps every array
    two-dimensional."""
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    if b.shape[0] == 1:
        if contract_b == 1:  # [m, k] x [1, k] -> [m, 1]
            return (a32 * b32).sum(1, keepdims=True)
        return a32 * b32  # [m, 1] x [1, n] -> [m, n]
    if contract_b == 1:  # [m, k] x [n, k] -> [m, n]
        return (a32[:, None, :] * b32[None, :, :]).sum(axis=2)
    return (a32[:, :, None] * b32[None, :, :]).sum(axis=1)  # [m, k] x [k, n]


@dataclasses.dataclass(frozen=True)
class OnlineSoftmax:
    """One program's attention state machine: `keys` and `values` are the KV head's segments,
    `q_parts` its queries split like the keys (`[rows, w]` each), `small(a, b)` says when a
    product is done by `broadcast_dot` instead of a matmul."""

    keys: Sequence[Segment]
    values: Sequence[Segment]
    q_parts: Sequence[Array]
    scale: float
    dtype: jnp.dtype
    small: Callable[[Array, Array], bool]

    def dot(self, a: Array, b: Array, contract_b: int) -> Array:
        if self.small(a, b):
            return broadcast_dot(a, b, contract_b)
        dims = (((1,), (contract_b,)), ((), ()))
        # f32 operands at full precision: Triton's default for them is TF32 (10-bit mantissa),
        # which moved a tiny DeepSeek model's greedy tokens on an H200; bf16 is unaffected
        exact = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
        return jax.lax.dot_general(a, b, dims, precision=exact, preferred_element_type=jnp.float32)

    def init(self, rows: int) -> tuple:
        """Empty accumulators (one per value segment), maxima and sums."""
        return (
            tuple(jnp.zeros((rows, w), jnp.float32) for _, w, _ in self.values),
            jnp.full((rows, 1), NEG, jnp.float32),
            jnp.zeros((rows, 1), jnp.float32),
        )

    def scores(self, load: Load) -> Array:
        """`[rows, keys]` scaled scores of the block `load` gives (the sum over key segments)."""
        out = None
        for (off, w, i), qp in zip(self.keys, self.q_parts):
            part = self.dot(qp, load(off, w, i), 1)
            out = part if out is None else out + part
        return out * self.scale

    def update(self, carry: tuple, s: Array, load: Load) -> tuple:
        """The state after the block whose (masked) scores are `s` and values `load` gives."""
        return self.update_blocks(carry, [(s, load)])

    def update_blocks(self, carry: tuple, blocks: Sequence[tuple[Array, Load]]) -> tuple:
        """The state after several blocks of keys at once (`(scores, load)` each, as `update`):
        one running max and one rescale for all of them, their value products summed. This is
        how a kernel attends several pages per step when it cannot join their tiles into one
        (Pallas-Triton concatenates only along the last axis)."""
        accs, m, denom = carry
        m_new = m
        for s, _ in blocks:
            m_new = jnp.maximum(m_new, s.max(axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        ps = [jnp.exp(s - m_new) for s, _ in blocks]
        l_new = alpha * denom
        for p in ps:
            l_new = l_new + p.sum(axis=1, keepdims=True)
        out = []
        for acc, (off, w, i) in zip(accs, self.values):
            acc = acc * alpha
            for p, (_, load) in zip(ps, blocks):
                acc = acc + self.dot(p.astype(self.dtype), load(off, w, i), 0)
            out.append(acc)
        return tuple(out), m_new, l_new


def store(outs: Sequence, carry: tuple, keep: Array, split: bool) -> None:
    """Writes a program's final state to its output refs: `[rows, dv]` normalized, or with
    `split` the unnormalized accumulator `[rows, dv]`, max and sum `[rows, 1]` for the combine.
    Rows where `keep` `[rows, 1]` is False (padding queries) get zeros and a zero sum."""
    accs, m, denom = carry
    denom = jnp.where(keep, denom, 0.0)
    start = 0
    for acc in accs:
        w = acc.shape[1]
        if split:
            outs[0][:, pl.ds(start, w)] = jnp.where(keep, acc, 0.0)
        else:
            out = jnp.where(keep, acc / jnp.where(keep, denom, 1.0), 0.0)
            outs[0][:, pl.ds(start, w)] = out.astype(outs[0].dtype)
        start += w
    if split:
        outs[1][...] = m
        outs[2][...] = denom


# The operands both forms take before the queries (`scalar_operands`): the index of the first
# query segment, and so of the pages operand an in-place write aliases.
SCALARS = 5


def scalar_operands(
    lens: Array, table: Array, layer: Array, write_lens: Array | None, new_lens: Array
) -> tuple[Array, ...]:
    """The `SCALARS` operands a paged kernel call starts with: cached lengths `[B]`, the page
    table `[B, M]`, the layer `[1]`, the new rows to write `[B]` (zeros when not writing) and
    the real new tokens `[B]`."""
    writes = jnp.zeros(lens.shape, jnp.int32) if write_lens is None else write_lens
    return lens, table, layer, writes, new_lens


def out_shapes(splits: int, lead: tuple[int, ...], dv: int, dtype) -> list[jax.ShapeDtypeStruct]:
    """What a kernel's programs write (`store`): the output `[*lead, dv]` in `dtype` or, with
    `splits` > 1, the partials `combine` takes: f32 accumulators `[splits, *lead, dv]`, running
    maxima and sums `[splits, *lead, 1]`."""
    if splits == 1:
        return [jax.ShapeDtypeStruct((*lead, dv), dtype)]
    return [jax.ShapeDtypeStruct((splits, *lead, w), jnp.float32) for w in (dv, 1, 1)]


def combine(partials: Sequence[Array], dtype) -> Array:
    """Split-KV's partial softmaxes (`out_shapes` with splits: `[S, ..., dv]` accumulators,
    `[S, ..., 1]` maxima and sums) -> the normalized output `[..., dv]` in `dtype`."""
    acc, m, denom = partials
    weight = jnp.exp(m - m.max(axis=0, keepdims=True))
    denom = (denom * weight).sum(0)  # zero for a padding query: its output is zero
    return ((acc * weight).sum(0) / jnp.where(denom > 0, denom, 1.0)).astype(dtype)
