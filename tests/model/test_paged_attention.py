"""The paged attention kernel (Pallas, interpret mode on CPU) against the dense oracle, the page
allocator and budget, and paged decode."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dualpath_jax.model import paged_attention as pa
from dualpath_jax.model.paged import PageAllocator, PagesExhausted, budget_pages, pages_for

LAYOUTS = {
    "gqa": (pa.RowLayout.gqa(2, 8), 4),  # 2 KV heads of 8, 2 queries per KV head
    "gqa_g3": (pa.RowLayout.gqa(2, 8), 6),
    "mha": (pa.RowLayout.gqa(3, 8), 3),
    "mla": (pa.RowLayout.mla(16, 8), 4),  # latent 16 + rope 8, one KV head, value = latent
}


def _width(layout: pa.RowLayout) -> int:
    if layout.head_stride:
        return 2 * layout.num_kv_heads * layout.value_width
    return layout.key_width


def _case(layout, hq, dtype, *, b=3, n=8, ps=4, p=20, layers=2, lens=(0, 5, 13), seed=0):
    rng = np.random.default_rng(seed)
    w = _width(layout)
    q = jnp.asarray(rng.normal(size=(b, n, hq, layout.key_width)), dtype)
    pages = jnp.asarray(rng.normal(size=(p, layers, ps, w)), dtype)
    m = 5
    table = jnp.asarray(rng.permutation(p)[: b * m].reshape(b, m), jnp.int32)
    new = jnp.asarray(rng.normal(size=(b, n, w)), dtype)
    return q, pages, table, jnp.asarray(lens, jnp.int32), new


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("block_q", [4, 8])
def test_kernel_matches_dense_oracle(name, block_q):
    layout, hq = LAYOUTS[name]
    q, pages, table, lens, new = _case(layout, hq, jnp.float32)
    scale = layout.key_width**-0.5
    for layer in (0, 1):
        got = pa.paged_attention(
            q, pages, table, lens, new, layout, scale, layer=layer, block_q=block_q
        )
        want = pa.paged_attention_reference(q, pages, table, lens, new, layout, scale, layer=layer)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-6)


def test_kernel_reads_pages_held_as_bits():
    layout, hq = LAYOUTS["gqa"]
    q, pages, table, lens, new = _case(layout, hq, jnp.bfloat16)
    bits = jax.lax.bitcast_convert_type(pages, jnp.uint16)
    scale = layout.key_width**-0.5
    got = pa.paged_attention(q, bits, table, lens, new, layout, scale, kv_dtype=jnp.bfloat16)
    want = pa.paged_attention(q, pages, table, lens, new, layout, scale)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="kv_dtype"):
        pa.paged_attention(q, bits, table, lens, new, layout, scale)


@pytest.mark.parametrize("name", ["gqa", "mla"])
def test_kernel_writes_new_rows_into_their_pages(name):
    layout, hq = LAYOUTS[name]
    q, pages, table, lens, new = _case(layout, hq, jnp.float32, n=4, lens=(0, 5, 11))
    bits = jax.lax.bitcast_convert_type(pages, jnp.uint32)
    write = jnp.asarray([4, 0, 2], jnp.int32)
    scale = layout.key_width**-0.5
    out, written = pa.paged_attention(
        q, bits, table, lens, new, layout, scale, layer=1, kv_dtype=jnp.float32, write_lens=write
    )
    want_pages = pa.write_pages(bits, table, lens, new, write, 1)
    np.testing.assert_array_equal(np.asarray(written), np.asarray(want_pages))
    plain = pa.paged_attention(q, pages, table, lens, new, layout, scale, layer=1)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))
    # The rows landed where the table says, and nothing else moved.
    got = np.asarray(jax.lax.bitcast_convert_type(written, jnp.float32))
    before = np.asarray(pages)
    t, ln = np.asarray(table), np.asarray(lens)
    changed = np.zeros(before.shape[:3], bool)  # [P, L, page_size]
    for b, k in enumerate(np.asarray(write)):
        for j in range(k):
            pos = ln[b] + j
            page, row = t[b, pos // 4], pos % 4
            np.testing.assert_array_equal(got[page, 1, row], np.asarray(new[b, j]))
            changed[page, 1, row] = True
    np.testing.assert_array_equal(got[~changed], before[~changed])


def test_allocator_allocates_frees_and_reuses():
    alloc = PageAllocator(4)
    assert alloc.free_pages == 4 and alloc.used_pages == 0
    a = alloc.allocate("a", 3)
    assert 0 not in a and len(set(a)) == 3  # page 0 is the null page
    assert alloc.pages("a") == a and alloc.can_allocate(1) and not alloc.can_allocate(2)
    with pytest.raises(PagesExhausted, match="2 KV pages needed, 1 of 4 free"):
        alloc.allocate("b", 2)
    assert alloc.free("a") == 3 and alloc.free("a") == 0
    b = alloc.allocate("b", 4)
    assert sorted(b) == [1, 2, 3, 4]
    assert pages_for(0, 64) == 0 and pages_for(64, 64) == 1 and pages_for(65, 64) == 2


def test_budget_pages():
    assert budget_pages(100, budget_bytes=1000) == 10
    assert budget_pages(100, default_pages=7) == 7
    with pytest.raises(ValueError, match="holds no page"):
        budget_pages(100, budget_bytes=99)
    with pytest.raises(ValueError, match="bad KV budget"):
        budget_pages(100, fraction=1.5)

    class Device:  # a device that reports its memory (CPU devices report none)
        def memory_stats(self):
            return {"bytes_limit": 10_000}

    assert budget_pages(100, fraction=0.5, device=Device()) == 50
    # a pool split over 4 devices by KV head: each holds a quarter of every page
    assert budget_pages(100, fraction=0.5, device=Device(), shards=4) == 200
    assert budget_pages(100, budget_bytes=1000, shards=4) == 10  # bytes of the whole pool
    if not (jax.devices()[0].memory_stats() or {}).get("bytes_limit"):
        with pytest.raises(ValueError, match="give the budget in bytes"):
            budget_pages(100, fraction=0.5)


def test_contiguous_rows_are_pages_with_an_identity_table():
    from dualpath_jax.model.layers import PagedKV

    rows = jnp.arange(2 * 48 * 3, dtype=jnp.float32).reshape(2, 48, 3)
    kv = PagedKV.contiguous(rows, jnp.asarray([10, 48]))
    assert kv.pages.shape == (6, 1, 16, 3) and kv.table.shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(pa.gather_pages(kv.pages, kv.table)), rows)
    assert dataclasses.replace(kv, write=None).write is None


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_layerwise_prefill_over_pages_equals_padded_rows(impl):
    """A ragged batch whose cached KV arrives per request in pages (`LayerPages`, what the PE
    builds from hit blocks) gives the logits and new KV of the padded-rows path."""
    from dualpath_jax.model.pages import LayerPages
    from dualpath_jax.model.runner import ModelRunner, PrefillBatch
    from dualpath_jax.model.transformer import init_model
    from dualpath_jax.presets import TINY_QWEN2

    cfg = dataclasses.replace(TINY_QWEN2, attention_impl=impl)
    runner = ModelRunner(init_model(cfg, seed=0))
    rs = np.random.RandomState(4)
    prompts = [rs.randint(0, cfg.vocab_size, n).tolist() for n in (40, 23, 57)]
    cached = [32, 0, 45]  # a whole number of 16-token pages, none, and a partial last page
    _, kv = runner.prefill_monolithic(PrefillBatch.build(cfg, prompts, [0, 0, 0]))
    kv = np.asarray(kv)  # [L, B, N_pad, W]
    batch = PrefillBatch.build(cfg, [p[c:] for p, c in zip(prompts, cached)], cached)

    def rows(i):
        out = np.zeros((3, batch.c_pad, cfg.kv_width), np.float32)
        for b, c in enumerate(cached):
            out[b, :c] = kv[i, b, :c]
        return out

    def pages(i):
        return LayerPages.from_rows(
            [kv[i, b, :c] for b, c in enumerate(cached)], 16, cfg.kv_width, np.float32
        )

    got_new, want_new = {}, {}
    got = runner.prefill_layerwise(batch, pages, lambda i, r: got_new.__setitem__(i, r))
    want = runner.prefill_layerwise(batch, rows, lambda i, r: want_new.__setitem__(i, r))
    np.testing.assert_allclose(np.asarray(got.last_logits), np.asarray(want.last_logits), atol=2e-5)
    for i in range(cfg.num_layers):
        np.testing.assert_allclose(np.asarray(got_new[i]), np.asarray(want_new[i]), atol=2e-5)
    assert pages(0).pages.shape == (8, 1, 16, cfg.kv_width)  # 2 + 0 + 3 pages + null, pow2


def test_compiled_block_padding_gives_the_same_output():
    """The zero queries that pad a group to a power of two (what the compiled kernel runs)
    change nothing: run padded in interpret mode by forcing the padding path's shapes."""
    layout, hq = LAYOUTS["gqa_g3"]  # 3 queries per KV head -> padded to 16 rows
    q, pages, table, lens, new = _case(layout, hq, jnp.float32, n=1, lens=(3, 9, 13))
    scale = layout.key_width**-0.5
    want = pa.paged_attention(q, pages, table, lens, new, layout, scale)
    import unittest.mock as mock

    # interpret=False picks the padding; the call itself still interprets (no GPU here).
    real = pa.pl.pallas_call
    with mock.patch.object(
        pa.pl, "pallas_call", lambda *a, **k: real(*a, **{**k, "interpret": True})
    ):
        got = pa.paged_attention(q, pages, table, lens, new, layout, scale, interpret=False)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)
