"""The model's KV in pages: the page pool's allocator and budget, `PagedKV` over contiguous rows,
and layerwise prefill over cached pages (`cached_kv.LayerPages`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dualpath_jax.kernels import paged_attention as pa
from dualpath_jax.model.page_pool import PageAllocator, PagesExhausted, budget_pages, pages_for


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
    from dualpath_jax.model.cached_kv import LayerPages
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


def test_one_layer_program_per_table_shape():
    """With `pad_to_table` (what the PE passes for attention that gathers pages) the page count
    follows from the table's shape: batches of one (B, N_pad, table width) whose requests need
    different numbers of pages run one compiled layer program, and so do the batch's first and
    later layers when the pages arrive committed to the device (as they do from a pinned
    buffer or the compute network) and the batch's own inputs do not. Logits equal those
    without padding."""
    from dualpath_jax.model import runner as runner_mod
    from dualpath_jax.model.cached_kv import LayerPages
    from dualpath_jax.model.runner import ModelRunner, PrefillBatch
    from dualpath_jax.model.transformer import init_model
    from dualpath_jax.presets import TINY_QWEN2

    cfg = TINY_QWEN2
    runner = ModelRunner(init_model(cfg, seed=0))
    assert runner.gathers_pages  # `auto` on CPU: the reference backend gathers
    rs = np.random.RandomState(7)
    w = cfg.kv_width

    def loader(rows, pad: bool, committed: bool = False):
        def load(i):
            lp = LayerPages.from_rows(rows, 16, w, np.float32, pad_to_table=pad)
            if committed:  # as a device program's output is
                lp = LayerPages(jax.device_put(lp.pages, jax.devices()[0]), lp.table)
            return lp

        return load

    def prefill(rows, load):
        batch = PrefillBatch.build(cfg, [[3, 4, 5]] * len(rows), [len(r) for r in rows])
        return runner.prefill_layerwise(batch, load).last_logits

    # 3 and 4 pages needed (4 + null, 5 + null: 8 pages unpadded either way), then 1 + 3
    # pages (5 + null: 8) and 4 + 4 (9: 16 pages unpadded): one table shape [2, 4]
    cases = [[40, 20], [33, 64], [16, 48], [64, 64]]
    for committed in (False, True):
        before = runner_mod._layer_paged._cache_size()
        for cached in cases:
            rows = [rs.randn(c, w).astype(np.float32) for c in cached]
            load = loader(rows, True, committed)
            prefill(rows, load)
            assert load(0).pages.shape[0] == 16 and load(0).table.shape == (2, 4)
        assert runner_mod._layer_paged._cache_size() - before <= 1
    assert loader([np.zeros((64, w), np.float32)] * 2, False)(0).pages.shape[0] == 16  # pow2(9)
    rows = [rs.randn(c, w).astype(np.float32) for c in (40, 20)]
    logits = [prefill(rows, loader(rows, pad)) for pad in (False, True)]
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(logits[1]), atol=2e-5)
