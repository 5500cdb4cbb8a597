"""Layerwise prefill equals the monolithic forward (logits and every layer's KV)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dualpath_jax.model import runner as runner_mod
from dualpath_jax.model.cached_kv import CachedPages, LayerPages
from dualpath_jax.model.runner import PrefillBatch, bucket_len, compile_count

ATOL = 2e-5


def reference(runner, tokens):
    """Monolithic forward over one whole sequence: logits [T, V], KV rows [L, T, W]."""
    model_fwd = runner.prefill_monolithic(
        PrefillBatch.build(runner.cfg, [tokens], [0]), all_logits=True
    )
    result, kv = model_fwd
    t = len(tokens)
    return np.asarray(result.logits[0, :t]), np.asarray(kv[:, 0, :t])


def host_kv(batch, refs, cached):
    """Per-layer loader of the cached KV rows [B, c_pad, W] from reference KV."""

    def load(i):
        rows = np.zeros((batch.batch_size, batch.c_pad, refs[0][1].shape[-1]), refs[0][1].dtype)
        for b, ((_, kv), c) in enumerate(zip(refs, cached)):
            rows[b, :c] = kv[i, :c]
        return rows

    return load


@pytest.mark.parametrize(
    "lengths",
    [
        [(0, 7)],  # no cache
        [(1, 5)],  # one cached token
        [(64, 9)],  # block boundary
        [(63, 2), (65, 1)],  # around a block boundary
        [(0, 5), (1, 9), (64, 3), (100, 20), (17, 33)],  # ragged batch
    ],
)
def test_layerwise_equals_monolithic(family_runner, lengths):
    cfg = family_runner.cfg
    rs = np.random.RandomState(len(lengths))
    seqs = [rs.randint(0, cfg.vocab_size, c + n).tolist() for c, n in lengths]
    refs = [reference(family_runner, s) for s in seqs]
    cached = [c for c, _ in lengths]
    batch = PrefillBatch.build(cfg, [s[c:] for s, c in zip(seqs, cached)], cached)
    emitted = {}
    loaded = []

    def load(i):
        loaded.append(i)
        return host_kv(batch, refs, cached)(i)

    res = family_runner.prefill_layerwise(
        batch, load, lambda i, rows: emitted.__setitem__(i, np.asarray(rows)), all_logits=True
    )
    assert sorted(emitted) == list(range(cfg.num_layers))
    assert loaded == ([] if batch.c_pad == 0 else list(range(cfg.num_layers)))
    for b, ((c, n), (logits, kv)) in enumerate(zip(lengths, refs)):
        np.testing.assert_allclose(np.asarray(res.logits[b, :n]), logits[c:], atol=ATOL, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(res.last_logits[b]), logits[-1], atol=ATOL, rtol=1e-5)
        for i in range(cfg.num_layers):
            np.testing.assert_allclose(emitted[i][b, :n], kv[i, c:], atol=ATOL, rtol=1e-5)


def test_monolithic_with_cache_equals_layerwise(family_runner):
    cfg = family_runner.cfg
    rs = np.random.RandomState(1)
    seqs = [rs.randint(0, cfg.vocab_size, 70).tolist(), rs.randint(0, cfg.vocab_size, 40).tolist()]
    refs = [reference(family_runner, s) for s in seqs]
    cached = [64, 30]
    batch = PrefillBatch.build(cfg, [s[c:] for s, c in zip(seqs, cached)], cached)
    load = host_kv(batch, refs, cached)
    all_kv = np.stack([load(i) for i in range(cfg.num_layers)])
    mono, new = family_runner.prefill_monolithic(batch, all_kv, all_logits=True)
    emitted = {}
    lw = family_runner.prefill_layerwise(batch, load, lambda i, r: emitted.__setitem__(i, r), True)
    np.testing.assert_allclose(np.asarray(mono.last_logits), np.asarray(lw.last_logits), atol=ATOL)
    for i in range(cfg.num_layers):
        np.testing.assert_allclose(np.asarray(new[i]), np.asarray(emitted[i]), atol=ATOL)


@pytest.mark.parametrize("chunks", [[10, 14], [1, 1, 22], [8, 8, 8]])
def test_chunked_equals_unchunked(family_runner, chunks):
    cfg = family_runner.cfg
    rs = np.random.RandomState(2)
    cached, n = 40, sum(chunks)
    seq = rs.randint(0, cfg.vocab_size, cached + n).tolist()
    logits_ref, kv_ref = reference(family_runner, seq)
    kv = kv_ref[:, :cached]  # grows by each chunk's new KV
    start = cached
    for size in chunks:
        batch = PrefillBatch.build(cfg, [seq[start : start + size]], [start])
        emitted = {}

        def load(i, kv=kv, batch=batch):
            rows = np.zeros((1, batch.c_pad, cfg.kv_width), kv.dtype)
            rows[0, : kv.shape[1]] = kv[i]
            return rows

        res = family_runner.prefill_layerwise(batch, load, emitted.__setitem__)
        new = np.stack([np.asarray(emitted[i][0, :size]) for i in range(cfg.num_layers)])
        kv = np.concatenate([kv, new], axis=1)
        start += size
    np.testing.assert_allclose(np.asarray(res.last_logits[0]), logits_ref[-1], atol=ATOL, rtol=1e-5)
    np.testing.assert_allclose(kv, kv_ref, atol=ATOL, rtol=1e-5)


def test_bad_inputs(tiny_runner):
    cfg = tiny_runner.cfg
    with pytest.raises(ValueError, match="out of range"):
        PrefillBatch.build(cfg, [[1, cfg.vocab_size]], [0])
    with pytest.raises(ValueError, match="out of range"):
        PrefillBatch.build(cfg, [[-1]], [0])
    with pytest.raises(ValueError, match="max_seq_len"):
        PrefillBatch.build(cfg, [[1, 2]], [cfg.max_seq_len - 1])
    with pytest.raises(ValueError, match="at least one new token"):
        PrefillBatch.build(cfg, [[]], [3])
    batch = PrefillBatch.build(cfg, [[1, 2, 3]], [20])
    bad = np.zeros((1, batch.c_pad + 1, cfg.kv_width), np.float32)
    with pytest.raises(ValueError, match="layer 0: cached KV rows have shape"):
        tiny_runner.prefill_layerwise(batch, lambda i: bad)
    with pytest.raises(ValueError, match="cached KV has shape"):
        tiny_runner.prefill_monolithic(batch, np.zeros((1, 1, 1, 1), np.float32))


def test_bucketing_bounds_compiles(tiny_runner_gqa_first):
    """20 ragged requests compile at most once per (new, cached) bucket pair."""
    cfg = tiny_runner_gqa_first.cfg
    rs = np.random.RandomState(3)
    reqs = [(int(rs.randint(0, 150)), int(rs.randint(1, 40))) for _ in range(20)]
    before = compile_count()
    shapes = set()
    for c, n in reqs:
        batch = PrefillBatch.build(cfg, [rs.randint(0, cfg.vocab_size, n).tolist()], [c])
        shapes.add((batch.n_pad, batch.c_pad))
        rows = jnp.zeros((1, batch.c_pad, cfg.kv_width), cfg.kv_dtype)
        tiny_runner_gqa_first.prefill_layerwise(batch, lambda i, rows=rows: rows)
    kinds = len(set(tiny_runner_gqa_first.layer_gds))
    # embed + head per N bucket, one layer compile per (kind, N, C) bucket pair.
    bound = len(shapes) * kinds + 2 * len({n for n, _ in shapes})
    assert compile_count() - before <= bound
    assert len(shapes) < len(reqs)


def test_bucket_len():
    assert [bucket_len(n) for n in (0, 1, 16, 17, 600, 1024, 1025, 4096, 4100)] == [
        0,
        16,
        16,
        32,
        1024,
        1024,
        2048,
        4096,
        5120,
    ]


def _layer_pages(cfg, refs, cached, page_size=16) -> list[LayerPages]:
    return [
        LayerPages.from_rows(
            [kv[i, :c] for (_, kv), c in zip(refs, cached)], page_size, cfg.kv_width, cfg.kv_dtype
        )
        for i in range(cfg.num_layers)
    ]


def _cached_pages(cfg, refs, cached, page_size=16):
    return CachedPages.from_layers(_layer_pages(cfg, refs, cached, page_size))


@pytest.mark.parametrize("where", ["pinned_host", "device"])
def test_one_program_prefill_equals_monolithic(family_runner, where):
    """`prefill_program` over every layer's cached pages (in pinned host memory, copied to the
    device inside the program, or resident on the device) equals the monolithic forward over
    the sequences, for a ragged batch with an uncached request."""
    cfg = family_runner.cfg
    rs = np.random.RandomState(5)
    lengths = [(16, 9), (48, 22), (0, 5), (33, 1)]
    seqs = [rs.randint(0, cfg.vocab_size, c + n).tolist() for c, n in lengths]
    refs = [reference(family_runner, s) for s in seqs]
    cached = [c for c, _ in lengths]
    batch = PrefillBatch.build(cfg, [s[c:] for s, c in zip(seqs, cached)], cached)
    pages = _cached_pages(cfg, refs, cached)
    kv = pages.to_host() if where == "pinned_host" else pages.to_device()
    assert kv.pages.sharding.memory_kind == where
    res, new = family_runner.prefill_program(batch, kv, all_logits=True)
    assert new.shape == (cfg.num_layers, batch.batch_size, batch.n_pad, cfg.kv_width)
    for b, ((c, n), (logits, kv_ref)) in enumerate(zip(lengths, refs)):
        np.testing.assert_allclose(np.asarray(res.logits[b, :n]), logits[c:], atol=ATOL, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(res.last_logits[b]), logits[-1], atol=ATOL, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(new[:, b, :n]), kv_ref[:, c:], atol=ATOL, rtol=1e-5)
    # Nothing cached: the same program with an empty page set.
    fresh = PrefillBatch.build(cfg, [seqs[0]], [0])
    res0, _ = family_runner.prefill_program(fresh)
    np.testing.assert_allclose(np.asarray(res0.last_logits[0]), refs[0][0][-1], atol=ATOL)


def test_one_program_prefill_rejects_pages_of_another_shape(tiny_runner):
    cfg = tiny_runner.cfg
    batch = PrefillBatch.build(cfg, [[1, 2, 3]], [16])
    pages = CachedPages(np.zeros((cfg.num_layers + 1, 2, 16, cfg.kv_width), np.float32),
                        np.zeros((1, 1), np.int32))  # fmt: skip
    with pytest.raises(ValueError, match="cached pages"):
        tiny_runner.prefill_program(batch, pages)


def test_one_program_prefill_copies_each_layer_inside_the_program(tiny_runner):
    """Lowered for a GPU (no GPU needed to lower): the pages argument lives in pinned host
    memory and each scan iteration annotates its layer's pages for device placement, i.e. the
    host-to-device copy is part of the compiled program, once per layer."""
    cfg = tiny_runner.cfg
    batch = PrefillBatch.build(cfg, [[1, 2, 3]], [16])
    ref_rows = np.zeros((cfg.num_layers, 16, cfg.kv_width), np.float32)
    kv = _cached_pages(cfg, [(None, ref_rows)], [16]).to_host()
    treedef, leaves = tiny_runner.stacked_leaves
    args = (
        tiny_runner.embed_gd, tiny_runner.layer_runs, tiny_runner.head_gd, treedef, False,
        leaves, jnp.asarray(batch.tokens), jnp.asarray(batch.positions()), kv.pages,
        jnp.asarray(kv.table), jnp.asarray(batch.cached_lens), jnp.asarray(batch.new_lens),
    )  # fmt: skip
    text = runner_mod._prefill_program.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert 'mhlo.memory_kind = "pinned_host"' in text
    # One placement per run of layers (Qwen2: one scan; DeepSeek: dense, then MoE), each of one
    # layer's pages `[P, page_size, W]` (not the run's `[n, P, page_size, W]`): each scan
    # iteration copies its own layer.
    placements = [line for line in text.splitlines() if "@annotate_device_placement" in line]
    assert len(placements) == len(tiny_runner.layer_runs) == text.count("stablehlo.while")
    _, p, ps, w = kv.pages.shape
    assert all(f"(tensor<{p}x{ps}x{w}x" in line for line in placements), placements


def test_compile_only_compiles_without_running_and_the_real_call_reuses_it(family_runner):
    """Under `compile_only` a forward's layers (and the one-program prefill) are compiled, not
    run: zeros of the right shapes come out; the same shapes run for real afterwards compile
    nothing more and give the forward's values (the warm-up's premise, engines/warmup.py)."""
    from dualpath_jax.engines.warmup import CompileCounter

    cfg = family_runner.cfg
    rs = np.random.RandomState(11)
    lengths = [(20, 7), (0, 3)]
    seqs = [rs.randint(0, cfg.vocab_size, c + n).tolist() for c, n in lengths]
    refs = [reference(family_runner, s) for s in seqs]
    cached = [c for c, _ in lengths]
    batch = PrefillBatch.build(cfg, [s[c:] for s, c in zip(seqs, cached)], cached)
    layers = _layer_pages(cfg, refs, cached)
    pages = CachedPages.from_layers(layers).to_device()
    with family_runner.compile_only():
        emitted = []
        dry = family_runner.prefill_layerwise(
            batch, layers.__getitem__, lambda i, r: emitted.append(r)
        )
        dry_program, dry_new = family_runner.prefill_program(batch, pages)
    assert not np.asarray(dry.last_logits).any() and not np.asarray(dry_new).any()
    assert len(emitted) == cfg.num_layers and not any(np.asarray(r).any() for r in emitted)
    counter = CompileCounter()
    res = family_runner.prefill_layerwise(batch, layers.__getitem__)
    full, new = family_runner.prefill_program(batch, pages)
    layer_programs = counter.programs
    assert res.last_logits.shape == dry.last_logits.shape and new.shape == dry_new.shape
    for b, (logits, _) in enumerate(refs):
        np.testing.assert_allclose(np.asarray(res.last_logits[b]), logits[-1], atol=ATOL, rtol=1e-5)
        np.testing.assert_allclose(
            np.asarray(full.last_logits[b]), logits[-1], atol=ATOL, rtol=1e-5
        )
    assert layer_programs == 0
