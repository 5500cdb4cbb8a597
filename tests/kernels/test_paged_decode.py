"""A decode step's attention a few pages at a time (`paged_decode_chunked`, the `reference`
backend's) equals the whole gather (`paged_decode_reference`, the oracle) for every row layout,
dtype, chunk and table width, idle rows (nothing written: zeros) and an empty context."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dualpath_jax.kernels.kv_rows import RowLayout, quantize_rows
from dualpath_jax.kernels.paged_decode import paged_decode_chunked, paged_decode_reference

FP8 = jnp.float8_e4m3fn
LAYOUTS = {
    "gqa": (RowLayout.gqa(2, 8), 4, jnp.float32),
    "gqa_bf16": (RowLayout.gqa(2, 8), 4, jnp.bfloat16),
    "mha": (RowLayout.gqa(3, 8), 3, jnp.float32),
    "mla": (RowLayout.mla(16, 8), 4, jnp.float32),
    "gqa_fp8": (RowLayout.gqa(2, 8, scaled=True), 4, FP8),
    "mla_fp8": (RowLayout.mla(256, 16, scaled=True), 4, FP8),
}


def _case(layout, hq, kv_dtype, *, m, ps=4, layers=2, lens=(0, 5, 13, 30), seed=0):
    b, rng = len(lens), np.random.default_rng(seed)
    p = b * m + 3
    q_dtype = jnp.float32 if kv_dtype == FP8 else kv_dtype
    q = jnp.asarray(rng.normal(size=(b, 1, hq, layout.key_width)), q_dtype)
    data = rng.normal(size=(p, layers, ps, layout.unscaled.row_width)).astype(np.float32)
    if layout.scaled:
        pages = jax.lax.bitcast_convert_type(
            quantize_rows(jnp.asarray(data), layout, FP8), jnp.uint8
        )
    else:
        pages = jnp.asarray(data, kv_dtype)
    table = jnp.asarray(rng.permutation(p)[: b * m].reshape(b, m), jnp.int32)
    return q, pages, table, jnp.asarray(lens, jnp.int32)


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("m, chunk", [(8, 2), (8, 8), (8, 16), (12, 8), (1, 16)])
def test_chunks_of_pages_equal_the_whole_gather(name, m, chunk):
    layout, hq, kv_dtype = LAYOUTS[name]
    lens = tuple(min(x, m * 4 - 1) for x in (0, 5, 13, 30))
    q, pages, table, lens = _case(layout, hq, kv_dtype, m=m, lens=lens)
    written = jnp.asarray([1, 1, 0, 1], jnp.int32)  # the third row is idle
    kw = dict(layer=1, kv_dtype=kv_dtype, written=written)
    want = paged_decode_reference(q, pages, table, lens, layout, 0.3, **kw)
    got = jax.jit(lambda *a: paged_decode_chunked(*a, layout, 0.3, chunk_pages=chunk, **kw))(
        q, pages, table, lens
    )
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = 2e-2 if jnp.dtype(q.dtype) == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol
    )
    assert not np.asarray(got[2]).any()  # idle: zeros
    assert np.isfinite(np.asarray(got, np.float32)).all()  # an empty context sees its own row
