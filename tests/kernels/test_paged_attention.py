"""The paged attention kernel (Pallas, interpret mode on CPU) against the dense oracle: reading
pages held as bits, writing new rows into their pages, the shapes it has when compiled for a GPU
(padded groups, KV splits) and its TPU form, all interpreted; and which kernel each platform's
lowering of one program holds."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dualpath_jax.kernels import paged_attention as pa
from dualpath_jax.kernels.kv_rows import RowLayout

LAYOUTS = {
    "gqa": (RowLayout.gqa(2, 8), 4),  # 2 KV heads of 8, 2 queries per KV head
    "gqa_g3": (RowLayout.gqa(2, 8), 6),
    "mha": (RowLayout.gqa(3, 8), 3),
    "mla": (RowLayout.mla(16, 8), 4),  # latent 16 + rope 8, one KV head, value = latent
}


def _width(layout: RowLayout) -> int:
    return layout.row_width


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


def _full(q, new_lens):
    return jnp.full((q.shape[0],), q.shape[1], jnp.int32) if new_lens is None else new_lens


def _compiled_shapes(q, pages, table, lens, new, layout, scale, *, layer=0, kv_dtype=None,
                     write_lens=None, kv_splits=None, pages_per_block=None,
                     new_lens=None):  # fmt: skip
    """The kernel with the shapes it has when compiled for a GPU (padded query groups, row
    blocks of 64, KV splits in decode, broadcast products for dots under 16), interpreted."""
    kv_dtype = jnp.dtype(kv_dtype or pages.dtype)
    return pa._paged_attention(
        q, pa.as_bits(pages), table, lens, new, jnp.asarray(layer, jnp.int32).reshape(1),
        write_lens, _full(q, new_lens), layout=layout, scale=scale, kv_dtype=kv_dtype, block_q=64,
        kv_splits=kv_splits, compiled=True, interpret=True, pages_per_block=pages_per_block,
    )  # fmt: skip


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("n", [1, 8])
def test_compiled_shapes_give_the_same_output(name, n):
    """What the GPU runs (Triton's shapes: padded groups, KV splits on decode, small products
    without dots) equals the interpreted kernel and the oracle."""
    layout, hq = LAYOUTS[name]
    q, pages, table, lens, new = _case(layout, hq, jnp.float32, n=n, lens=(3, 9, 13))
    scale = layout.key_width**-0.5
    want = pa.paged_attention_reference(q, pages, table, lens, new, layout, scale, layer=1)
    for splits in (None, 1, 2, 3):
        got = _compiled_shapes(q, pages, table, lens, new, layout, scale, layer=1, kv_splits=splits)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-6, rtol=3e-6)


def test_interpreted_split_kv_matches():
    layout, hq = LAYOUTS["gqa"]
    q, pages, table, lens, new = _case(layout, hq, jnp.float32, n=4, lens=(0, 6, 17))
    scale = layout.key_width**-0.5
    want = pa.paged_attention_reference(q, pages, table, lens, new, layout, scale)
    got = pa.paged_attention(q, pages, table, lens, new, layout, scale, kv_splits=3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-6, rtol=3e-6)
    with pytest.raises(ValueError, match="kv_splits"):
        pa.paged_attention(q, pages, table, lens, new, layout, scale, kv_splits=0)


def _tpu_form(q, pages, table, lens, new, layout, scale, *, layer=0, kv_dtype=None,
              write_lens=None, kv_splits=None, pages_per_block=None, new_lens=None):  # fmt: skip
    """The TPU form of the kernel (pages and new rows in HBM, DMAs into VMEM), interpreted."""
    kv_dtype = jnp.dtype(kv_dtype or pages.dtype)
    return pa._paged_attention_tpu(
        q, pa.as_bits(pages), table, lens, new, jnp.asarray(layer, jnp.int32).reshape(1),
        write_lens, _full(q, new_lens), layout=layout, scale=scale, kv_dtype=kv_dtype,
        interpret=True,
        kv_splits=kv_splits, pages_per_block=pages_per_block,
    )  # fmt: skip


# Every form of the kernel, interpreted, with its pages-per-step and KV splits given
FORMS = {
    "interpret": lambda *a, **k: pa.paged_attention(*a, **k, interpret=True),
    "gpu": lambda *a, pages_per_compute_block, **k: _compiled_shapes(
        *a, **k, pages_per_block=pages_per_compute_block
    ),
    "tpu": lambda *a, pages_per_compute_block, **k: _tpu_form(
        *a, **k, pages_per_block=pages_per_compute_block
    ),
}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("name", ["gqa", "mla"])
def test_several_pages_per_step_match_the_oracle(form, name):
    """A program attending 2, 3 or 5 pages per step, alone or split over its pages (a step
    running past a split's end into the next split's live pages, or past the request's last
    page), equals the oracle, prefill and decode."""
    layout, hq = LAYOUTS[name]
    scale = layout.key_width**-0.5
    for n in (1, 4):
        q, pages, table, lens, new = _case(layout, hq, jnp.float32, n=n, lens=(3, 9, 17))
        want = pa.paged_attention_reference(q, pages, table, lens, new, layout, scale, layer=1)
        for ppb, splits in ((2, None), (3, None), (5, None), (2, 2), (3, 2), (2, 3)):
            got = FORMS[form](q, pages, table, lens, new, layout, scale, layer=1,
                              kv_splits=splits, pages_per_compute_block=ppb)  # fmt: skip
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-6, rtol=3e-6)


RAGGED_FORMS = {
    "interpret": lambda *a, **k: pa.paged_attention(*a, **k, interpret=True, block_q=4),
    "gpu": _compiled_shapes,
    "gpu-3-splits": functools.partial(_compiled_shapes, kv_splits=3),
    "tpu": _tpu_form,
    "tpu-2-splits": functools.partial(_tpu_form, kv_splits=2),
}


@pytest.mark.parametrize("form", list(RAGGED_FORMS))
@pytest.mark.parametrize("name", ["gqa", "mla"])
@pytest.mark.parametrize("n", [8, 160])
def test_a_ragged_batch_attends_its_real_tokens_only(form, name, n):
    """Requests of n, 3 and 1 real new tokens (a prefill chunk, a short one, a decode token)
    in one padded call: each real query's output is what the request alone gives (the oracle
    over its own length), padding queries get zeros; with 160 tokens the GPU and TPU forms have
    several row blocks, and the padding's blocks attend nothing."""
    layout, hq = LAYOUTS[name]
    q, pages, table, lens, new = _case(layout, hq, jnp.float32, n=n, lens=(3, 9, 17))
    scale = layout.key_width**-0.5
    new_lens = jnp.asarray([n, 3, 1], jnp.int32)
    got = np.asarray(RAGGED_FORMS[form](q, pages, table, lens, new, layout, scale, layer=1,
                                        new_lens=new_lens))  # fmt: skip
    for b, k in enumerate(np.asarray(new_lens)):
        one = [x[b : b + 1] for x in (q[:, :k], pages, table, lens, new[:, :k])]
        one[1] = pages
        want = pa.paged_attention_reference(*one, layout, scale, layer=1)
        np.testing.assert_allclose(got[b, :k], np.asarray(want[0]), atol=3e-6, rtol=3e-6)
        assert not got[b, k:].any()
    oracle = pa.paged_attention_reference(
        q, pages, table, lens, new, layout, scale, layer=1, new_lens=new_lens
    )
    np.testing.assert_allclose(got, np.asarray(oracle), atol=3e-6, rtol=3e-6)


def test_pages_per_step_default_to_a_block_of_keys():
    """By default a step holds the whole pages of 128 keys (GPU) or 512 (TPU), at least one,
    never more than a split's share of the table; asking for fewer than one is an error."""
    assert pa._pages_per_block(64, 64, 1, None, pa._BLOCK_KEYS) == 2
    assert pa._pages_per_block(64, 64, 1, None, pa._TPU_BLOCK_KEYS) == 8
    assert pa._pages_per_block(64, 256, 1, None, pa._BLOCK_KEYS) == 1
    assert pa._pages_per_block(16, 16, 8, None, pa._TPU_BLOCK_KEYS) == 2
    assert pa._pages_per_block(16, 16, 1, 3, pa._BLOCK_KEYS) == 3
    layout, hq = LAYOUTS["gqa"]
    q, pages, table, lens, new = _case(layout, hq, jnp.float32)
    with pytest.raises(ValueError, match="pages_per_compute_block"):
        pa.paged_attention(q, pages, table, lens, new, layout, 1.0, pages_per_compute_block=0)


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("n", [1, 8])
def test_tpu_form_matches_the_oracle(name, n):
    """The TPU form, whole and split over its pages (split-KV: a split may hold no live page,
    or only the causal part), equals the oracle."""
    layout, hq = LAYOUTS[name]
    q, pages, table, lens, new = _case(layout, hq, jnp.float32, n=n, lens=(3, 9, 13))
    scale = layout.key_width**-0.5
    want = pa.paged_attention_reference(q, pages, table, lens, new, layout, scale, layer=1)
    for splits in (None, 2, 3):
        got = _tpu_form(q, pages, table, lens, new, layout, scale, layer=1, kv_splits=splits)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-6, rtol=3e-6)


def test_tpu_decode_splits_a_long_context_by_default():
    """Decode over 16 page-table columns: the TPU form splits the pages 4 ways (split-KV) by
    default, as the GPU form does, and still equals the oracle."""
    layout, hq = LAYOUTS["gqa"]
    q, pages, table, lens, new = _case(layout, hq, jnp.float32, n=1, p=48, lens=(60, 1, 33))
    table = jnp.asarray(np.random.default_rng(5).permutation(48)[:48].reshape(3, 16), jnp.int32)
    assert pa._decode_splits(1, table.shape[1], None) == 4
    assert pa._decode_splits(8, table.shape[1], None) == 1
    scale = layout.key_width**-0.5
    want = pa.paged_attention_reference(q, pages, table, lens, new, layout, scale, layer=1)
    got = _tpu_form(q, pages, table, lens, new, layout, scale, layer=1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-6, rtol=3e-6)


# The kernel's forms that write rows into their pages, as they run on each platform (interpreted)
WRITING_FORMS = {
    "gpu-2-splits": functools.partial(_compiled_shapes, kv_splits=2),
    "gpu-3-splits": functools.partial(_compiled_shapes, kv_splits=3),
    "tpu": _tpu_form,
    "tpu-3-splits": functools.partial(_tpu_form, kv_splits=3),
}


@pytest.mark.parametrize("form", list(WRITING_FORMS))
@pytest.mark.parametrize("name", ["gqa", "mla"])
def test_every_form_writes_like_the_scatter(name, form):
    layout, hq = LAYOUTS[name]
    q, pages, table, lens, new = _case(layout, hq, jnp.float32, n=1, lens=(0, 5, 11))
    bits = jax.lax.bitcast_convert_type(pages, jnp.uint32)
    write = jnp.asarray([1, 0, 1], jnp.int32)
    scale = layout.key_width**-0.5
    out, written = WRITING_FORMS[form](q, bits, table, lens, new, layout, scale, layer=1,
                                       kv_dtype=jnp.float32, write_lens=write)  # fmt: skip
    np.testing.assert_array_equal(
        np.asarray(written), np.asarray(pa.write_pages(bits, table, lens, new, write, 1))
    )
    want = pa.paged_attention(q, pages, table, lens, new, layout, scale, layer=1)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=3e-6, rtol=3e-6)


def test_the_program_lowers_for_gpu_and_tpu_with_their_kernel():
    """One traced program, three platforms: Triton's custom call for cuda, Mosaic's for tpu,
    and the interpreter (no custom call) on this CPU."""
    layout, hq = RowLayout.gqa(2, 128), 8
    sds = jax.ShapeDtypeStruct
    args = (
        sds((2, 16, hq, 128), jnp.bfloat16),
        sds((9, 2, 16, 512), jnp.uint16),
        sds((2, 4), jnp.int32),
        sds((2,), jnp.int32),
        sds((2, 16, 512), jnp.bfloat16),
    )

    def f(q, pages, table, lens, new):
        return pa.paged_attention(
            q, pages, table, lens, new, layout, 0.1, layer=1, kv_dtype=jnp.bfloat16,
            write_lens=lens,
        )  # fmt: skip

    calls = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
    decode = (args[0].update(shape=(2, 1, hq, 128)), args[1], sds((2, 16), jnp.int32), args[3],
              args[4].update(shape=(2, 1, 512)))  # fmt: skip
    for shapes in (args, decode):  # prefill, and decode split 4 ways over 16 pages
        traced = jax.jit(f).trace(*shapes)
        for platform, call in calls.items():
            text = traced.lower(lowering_platforms=(platform,)).as_text()
            assert text.count(call) == 1
            assert not any(other in text for other in calls.values() if other != call)
        assert not any(c in traced.lower().as_text() for c in calls.values())


@pytest.mark.parametrize(("dtype", "want"), [(jnp.float32, {"ieee"}), (jnp.bfloat16, {"tf32"})])
def test_f32_pages_are_multiplied_at_full_precision_by_triton(monkeypatch, dtype, want):
    """Triton multiplies f32 operands in TF32 unless told otherwise (on an H200 that moved a
    tiny DeepSeek model's greedy tokens under the kernel): the GPU form asks for IEEE products
    of f32 pages; bf16 products are bf16 whatever the flag says."""
    lowering = pytest.importorskip("jax._src.pallas.triton.lowering")
    seen, dot = [], lowering.tt_dialect.dot

    def spy(a, b, acc, input_precision=None, **kw):
        seen.append(str(input_precision))
        return dot(a, b, acc, input_precision=input_precision, **kw)

    monkeypatch.setattr(lowering.tt_dialect, "dot", spy)
    layout = RowLayout.gqa(2, 16)  # dots of 16 and more: a matmul, not a broadcast product
    q, pages, table, lens, new = (
        jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _case(layout, 4, dtype, n=16, ps=16)
    )
    attend = jax.jit(functools.partial(pa.paged_attention, layout=layout, scale=0.25))
    attend.trace(q, pages, table, lens, new).lower(lowering_platforms=("cuda",))
    assert seen and set(seen) == want


@pytest.mark.parametrize("name", ["gqa", "mla"])
def test_the_dense_path_skips_blocks_of_padding_queries(name):
    """With real new tokens per request (`new_lens`) and more queries than a block, the
    `reference` path attends a block of queries at a time and skips the blocks of padding:
    each real query's output is the whole computation's, the padding's zero."""
    from dualpath_jax.kernels.dense_attention import QUERY_BLOCK

    layout, hq = LAYOUTS[name]
    n = 2 * QUERY_BLOCK
    q, pages, table, lens, new = _case(layout, hq, jnp.float32, n=n)
    scale = layout.key_width**-0.5
    new_lens = jnp.asarray([n, QUERY_BLOCK + 3, 5], jnp.int32)  # 2, 2 and 1 blocks of real ones
    whole = pa.paged_attention_reference(q, pages, table, lens, new, layout, scale, layer=1)
    got = jax.jit(
        functools.partial(pa.paged_attention_reference, layout=layout, scale=scale, layer=1)
    )(q, pages, table, lens, new, new_lens=new_lens)
    real = np.arange(n)[None, :] < np.asarray(new_lens)[:, None]
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(whole)[real], atol=1e-5)
    assert not np.asarray(got)[~real].any()
    # a loop over (request, block) steps, each a branch: attend, or zeros for padding
    hlo = (
        jax.jit(
            functools.partial(pa.paged_attention_reference, layout=layout, scale=scale, layer=1)
        )
        .lower(q, pages, table, lens, new, new_lens=new_lens)
        .as_text()
    )
    assert "stablehlo.while" in hlo and "stablehlo.case" in hlo
