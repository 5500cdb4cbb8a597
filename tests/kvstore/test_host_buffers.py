"""Host buffers (PE/DE buffer): bounded reservations, back-pressure, slot reuse, views."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dualpath_jax.kvstore import BufferFull, HostBufferPool
from dualpath_jax.model.layout import BlockLayout

LAYOUT = BlockLayout(3, 4, 12)


@pytest.fixture
def pool() -> HostBufferPool:
    return HostBufferPool(LAYOUT, 5, "DE buffer")


def test_slab_shape(pool):
    assert pool.slab.shape == (5, 3, 4, 12) and pool.slab.dtype == np.uint8
    assert HostBufferPool.for_bytes(LAYOUT, 10.5 * LAYOUT.nbytes).capacity_blocks == 10


def test_over_reservation_is_refused_and_recovers_after_release(pool):
    with pytest.raises(BufferFull, match="more than the whole buffer"):
        pool.reserve(6)
    a = pool.reserve(3, owner="r1")
    b = pool.try_reserve(2, owner="r2")
    assert b is not None and pool.free_blocks == 0
    assert pool.try_reserve(1) is None
    with pytest.raises(BufferFull) as err:
        pool.reserve(1)
    assert (err.value.requested, err.value.free, err.value.capacity) == (1, 0, 5)
    a.release()
    a.release()  # idempotent
    assert pool.free_blocks == 3
    c = pool.reserve(3)
    assert sorted(c.slots) == sorted(a.slots)  # the same memory comes back
    st = pool.stats()
    assert (st.used_blocks, st.refused, st.peak_used_blocks, st.reservations) == (5, 3, 5, 3)


def test_views_share_the_slab(pool):
    with pool.reserve(2) as res:
        res.block(0)[:] = 7
        res.layer_block(1, 2)[:] = 9
        assert np.shares_memory(res.block(0), pool.slab)
        assert res.layer_block(1, 2).shape == (1, 4, 12)
        assert (pool.slab[res.slots[0]] == 7).all()
        assert (pool.slab[res.slots[1], 2] == 9).all() and (pool.slab[res.slots[1], :2] != 9).all()
        layer = res.layer(2)
        assert layer.shape == (2, 4, 12) and (layer[1] == 9).all()
    with pytest.raises(RuntimeError, match="released"):
        res.block(0)


def test_layer_of_scattered_slots(pool):
    a = pool.reserve(2)
    b = pool.reserve(2)
    a.release()
    with pool.reserve(3) as c:
        for i in range(3):
            c.block(i)[:] = i + 1
        np.testing.assert_array_equal(c.layer(0)[:, 0, 0], [1, 2, 3])
    b.release()


def test_blocking_reserve_waits_for_a_release(pool):
    held = pool.reserve(5)
    got = []

    def waiter():
        got.append(pool.reserve(2, timeout_s=30))

    t = threading.Thread(target=waiter)
    t.start()
    held.release()
    t.join()
    assert len(got[0]) == 2


def test_no_allocation_per_reservation(pool):
    base = pool.slab.ctypes.data
    for _ in range(20):
        with pool.reserve(5) as res:
            for blk in res.blocks():
                assert blk.base is pool.slab or blk.base is pool.slab.base
                off = blk.ctypes.data - base
                assert 0 <= off < pool.slab.nbytes


def test_bad_requests(pool):
    with pytest.raises(ValueError):
        pool.reserve(-1)
    with pytest.raises(ValueError):
        HostBufferPool(LAYOUT, 0)
    assert len(pool.reserve(0)) == 0


def test_engine_buffers_hold_a_long_context_of_the_served_model():
    """`for_config`: room for `cluster.host_buffer_tokens` tokens of the model at hand (not a
    fixed byte count that holds ~1K tokens of a 7B model), at least `dram_buffer_bytes`; a
    prompt larger than the whole buffer is refused with the settings named."""
    import dataclasses

    from dualpath_jax.config import ExperimentConfig
    from dualpath_jax.presets import QWEN25_7B, TINY_QWEN2

    base = ExperimentConfig()
    for model in (QWEN25_7B, TINY_QWEN2):
        cfg = dataclasses.replace(base, model=model)
        layout = BlockLayout.for_model(model, cfg.store.block_tokens)
        blocks = -(-cfg.cluster.host_buffer_tokens // layout.block_tokens)
        want = max(blocks, int(cfg.hardware.dram_buffer_bytes // layout.nbytes))
        assert want * layout.block_tokens >= 65536
        if model is QWEN25_7B:  # 64K tokens of 7B KV: 3.5 GiB, far past the 64 MiB floor
            assert want == blocks
            continue
        small = dataclasses.replace(
            cfg,
            cluster=dataclasses.replace(cfg.cluster, host_buffer_tokens=4 * layout.block_tokens),
            hardware=dataclasses.replace(cfg.hardware, dram_buffer_bytes=layout.nbytes),
        )
        pool = HostBufferPool.for_config(small, layout, "DE buffer")
        assert pool.capacity_blocks == 4
        with pytest.raises(BufferFull, match="cluster.host_buffer_tokens"):
            pool.reserve(5)


def test_the_default_slab_is_pinned_host_memory_viewed_in_place():
    """The default pool's slab is a `pinned_host` jax array; the numpy view the store reads
    into writes those very bytes (no staging copy)."""
    pool = HostBufferPool(LAYOUT, 5, "PE buffer")
    assert pool.memory == "pinned_host" and pool.pinned.sharding.memory_kind == "pinned_host"
    assert pool.pinned.shape == pool.slab.shape and pool.slab.flags.writeable
    with pool.reserve(2) as res:
        res.block(1)[2, 3] = np.arange(12, dtype=np.uint8)
        assert np.asarray(pool.pinned)[res.slots[1], 2, 3].tolist() == list(range(12))
    paged = HostBufferPool(LAYOUT, 5, "DE buffer", memory="pageable")
    assert paged.pinned is None and paged.memory == "pageable"
    with pytest.raises(ValueError, match="memory must be one of"):
        HostBufferPool(LAYOUT, 5, memory="hbm")


@pytest.mark.parametrize("memory", ["pinned_host", "pageable"])
def test_layer_pages_copy_one_layer_of_the_blocks_to_the_device(memory):
    """`layer_pages`: layer `l` of blocks `[first, first + count)` on the device, padded with
    copies of the first block, counted as one host-to-device copy of the pages' bytes."""
    from dualpath_jax.copies import COPIES

    pool = HostBufferPool(LAYOUT, 6, memory=memory)
    pool.reserve(1)  # the next reservation's slots do not start at 0
    res = pool.reserve(4)
    rs = np.random.RandomState(0)
    for i in range(4):
        res.block(i)[:] = rs.randint(0, 256, LAYOUT.shape, dtype=np.uint8)
    COPIES.reset()
    got = res.layer_pages(1, 2, 2, pad_to=4, purpose="test")
    assert got.shape == (4, 4, 12) and got.sharding.memory_kind == "device"
    want = [res.block(1)[2], res.block(2)[2], res.block(1)[2], res.block(1)[2]]
    np.testing.assert_array_equal(np.asarray(got), np.stack(want))
    assert COPIES.copies("h2d", "test") == 1
    assert COPIES.nbytes("h2d", "test") == 4 * LAYOUT.layer_nbytes
    with pytest.raises(ValueError, match=r"blocks \[3, 5\) of a reservation of 4"):
        res.layer_pages(3, 2, 0)


def test_the_pinned_layer_copy_lowers_to_page_moves_from_pinned_host_memory():
    """Lowered for a GPU, the copy takes the slab in `pinned_host` memory and moves one page per
    step to device memory (a loop of slice + device placement, not a host-side gather)."""
    import jax
    import jax.numpy as jnp

    from dualpath_jax.kvstore import buffers

    pool = HostBufferPool(LAYOUT, 5)
    ids = jnp.zeros((2,), jnp.int32)
    lowered = buffers._slab_layer_to_device.trace(pool.pinned, ids, jnp.int32(1))
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    assert 'mhlo.memory_kind = "pinned_host"' in text
    placements = [line for line in text.splitlines() if "@annotate_device_placement" in line]
    assert len(placements) == 1 and "(tensor<4x12xui8>" in placements[0], placements
    assert text.count("stablehlo.while") == 1 and "stablehlo.gather" not in text
    assert jax.devices()[0].platform == "cpu"  # and it runs here too (the test above)


def test_released_slots_are_rewritten_only_after_their_copies_ran():
    """A copy out of pinned slots is dispatched, not done, when `layer_pages` returns: queued
    behind a busy device it would read whatever the slots' next owner wrote (the PE's prefix
    rows sent to a DE once read another request's KV this way). `release` waits for it."""
    import jax
    import jax.numpy as jnp

    pool = HostBufferPool(LAYOUT, 2)
    busy = jax.jit(lambda x: jax.lax.fori_loop(0, 24, lambda i, y: jnp.tanh(y @ y), x))
    x = jnp.full((384, 384), 1e-3, jnp.float32)
    busy(x).block_until_ready()
    for _ in range(3):
        res = pool.reserve(2, owner="a")
        for i in range(2):
            res.block(i)[...] = 7
        running = busy(x)  # the device is busy ...
        pages = res.layer_pages(0, 2, 1)  # ... and the copy waits behind it
        res.release()
        nxt = pool.reserve(2, owner="b")  # the same slots, rewritten by their next owner
        for i in range(2):
            nxt.block(i)[...] = 9
        assert (np.asarray(pages) == 7).all()
        nxt.release()
        running.block_until_ready()
