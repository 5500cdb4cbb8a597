"""Packed prefill (model/packing.py): a batch mixing long and short requests runs its token-wise
work over its real tokens only, and gives the padded layout's logits and KV rows, through every
prefill path (monolithic, layerwise over cached pages, one program), every family, and the
paged kernel."""

from __future__ import annotations

import contextlib
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from dualpath_jax import model as dm
from dualpath_jax.model.batch import packed_length
from dualpath_jax.model.cached_kv import CachedPages, LayerPages
from dualpath_jax.model.packing import Packing, plan
from dualpath_jax.model.runner import ModelRunner, PrefillBatch
from dualpath_jax.presets import TINY_DEEPSEEK, TINY_QWEN2

ATOL = 2e-5
# (cached, new): one long request with short ones, as agentic turns mix them
MIXED = [(0, 40), (17, 3), (64, 5), (3, 1), (30, 9)]


def test_plan_places_each_real_token_once():
    tokens = np.array([[5, 6, 7, 0], [8, 0, 0, 0], [1, 2, 0, 0]], np.int32)
    new, cached = np.array([3, 1, 2], np.int32), np.array([10, 0, 4], np.int32)
    p = plan(tokens, new, cached, 8)
    assert p.tokens.tolist() == [[5, 6, 7, 8, 1, 2, 0, 0]]
    assert p.positions.tolist() == [[10, 11, 12, 0, 4, 5, 0, 0]]
    assert p.index.tolist() == [[0, 1, 2, 8], [3, 8, 8, 8], [4, 5, 8, 8]]
    assert p.last.tolist() == [2, 3, 5]
    assert p.flat[:6].tolist() == [0, 1, 2, 4, 8, 9]
    packing = Packing(jnp.asarray(p.index), jnp.asarray(p.flat), jnp.asarray(p.last))
    x = jnp.asarray(np.arange(3 * 4 * 2, dtype=np.float32).reshape(3, 4, 2))
    padded = np.asarray(packing.pad(packing.pack(x)))
    real = np.arange(4)[None, :] < new[:, None]
    assert np.array_equal(padded[real], np.asarray(x)[real]) and not padded[~real].any()
    with pytest.raises(ValueError, match="do not fit"):
        plan(tokens, new, cached, 4)


def test_a_batch_is_packed_only_where_that_halves_its_rows():
    cfg = TINY_QWEN2
    assert PrefillBatch.build(cfg, [[1] * 40], [0]).packed() is None  # one request
    assert PrefillBatch.build(cfg, [[1] * 20, [1] * 20], [0, 0]).packed() is None  # 64 of 64
    p = PrefillBatch.build(cfg, [[1] * n for _, n in MIXED], [c for c, _ in MIXED]).packed()
    assert p is not None and p.length == 64  # 58 tokens, instead of 5 x 64 rows
    assert packed_length(58, 5, 64) == 64 and packed_length(33, 2, 32) == 0


@pytest.fixture(scope="module", params=["qwen2", "deepseek"])
def model(request):
    return dm.init_model({"qwen2": TINY_QWEN2, "deepseek": TINY_DEEPSEEK}[request.param], seed=0)


@contextlib.contextmanager
def padded(runner: ModelRunner):
    """`runner` with packing off (its padded layout), for the same parameters."""
    runner.pack = False
    try:
        yield runner
    finally:
        runner.pack = True


def _mixed(cfg, seed=0):
    rs = np.random.RandomState(seed)
    seqs = [rs.randint(0, cfg.vocab_size, c + n).tolist() for c, n in MIXED]
    return seqs, [c for c, _ in MIXED]


def _pages(runner, seqs, cached):
    """Each layer's cached KV of `seqs` up to `cached`, in pages (from one padded forward)."""
    cfg = runner.cfg
    with padded(runner):
        _, kv = runner.prefill_monolithic(PrefillBatch.build(cfg, seqs, [0] * len(seqs)))
    kv = np.asarray(kv)
    return [
        LayerPages.from_rows(
            [kv[i, b, :c] for b, c in enumerate(cached)], 16, cfg.kv_width, kv.dtype
        )
        for i in range(cfg.num_layers)
    ]


def _check(got, want, new_rows=None, want_rows=None):
    np.testing.assert_allclose(np.asarray(got.last_logits), np.asarray(want.last_logits), atol=ATOL)
    if got.logits is not None:
        for b, (_, n) in enumerate(MIXED):
            np.testing.assert_allclose(
                np.asarray(got.logits[b, :n]), np.asarray(want.logits[b, :n]), atol=ATOL
            )
    if new_rows is not None:
        for b, (_, n) in enumerate(MIXED):
            np.testing.assert_allclose(
                np.asarray(new_rows[:, b, :n], np.float32),
                np.asarray(want_rows[:, b, :n], np.float32),
                atol=ATOL,
            )


def test_packed_prefill_equals_the_padded_layout_on_every_path(model):
    runner = ModelRunner(model)
    cfg = runner.cfg
    seqs, cached = _mixed(cfg)
    tail = PrefillBatch.build(cfg, [s[c:] for s, c in zip(seqs, cached)], cached)
    assert runner.pack and tail.packed(runner.min_bucket) is not None
    layers = _pages(runner, seqs, cached)
    # layerwise over cached pages, every token's logits and every layer's new rows
    rows, want_rows = {}, {}
    got = runner.prefill_layerwise(tail, layers.__getitem__, rows.__setitem__, all_logits=True)
    with padded(runner):
        want = runner.prefill_layerwise(
            tail, layers.__getitem__, want_rows.__setitem__, all_logits=True
        )
    stack = [np.stack([np.asarray(r[i]) for i in range(cfg.num_layers)]) for r in (rows, want_rows)]
    _check(got, want, *stack)
    # one program over the same pages
    pages = CachedPages.from_layers(layers)
    res, new = runner.prefill_program(tail, pages)
    _check(res, want, np.asarray(new), stack[1])
    # the monolithic forward over contiguous rows (nothing cached)
    whole = PrefillBatch.build(cfg, [s[c:] for s, c in zip(seqs, cached)], [0] * len(seqs))
    got, new = runner.prefill_monolithic(whole, all_logits=True)
    with padded(runner):
        want, want_new = runner.prefill_monolithic(whole, all_logits=True)
    _check(got, want, np.asarray(new), np.asarray(want_new))


def test_packed_prefill_under_the_paged_kernel():
    """The kernel (interpret mode here) attends the padded layout the packed layers hand it."""
    cfg = dataclasses.replace(TINY_QWEN2, attention_impl="pallas")
    runner = ModelRunner(dm.init_model(cfg, seed=0))
    seqs, cached = _mixed(cfg, seed=1)
    tail = PrefillBatch.build(cfg, [s[c:] for s, c in zip(seqs, cached)], cached)
    layers = _pages(runner, seqs, cached)
    got = runner.prefill_layerwise(tail, layers.__getitem__)
    with padded(runner):
        want = runner.prefill_layerwise(tail, layers.__getitem__)
    _check(got, want)
