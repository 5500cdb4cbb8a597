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
