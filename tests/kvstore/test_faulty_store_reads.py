"""The fault-injecting store (`testing.faulty.FaultyStore`) reads into the destinations of the
store it wraps, and its faults surface the same way whatever the destination."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from dualpath_jax.kvstore import (
    DestinationKind,
    DeviceDestination,
    HostBufferPool,
    StoreError,
    UnsupportedDestination,
    block_keys,
    buffer_destination,
)
from dualpath_jax.testing.fault_plan import FaultPlan
from dualpath_jax.testing.faulty import FaultyStore


@pytest.fixture
def faulty(make_store, tmp_path):
    """`faulty(rules)`: the parametrized backend wrapped in a FaultyStore obeying `rules`."""

    def make(rules=()) -> FaultyStore:
        path = tmp_path / "faults.json"
        path.write_text(json.dumps({"rules": list(rules)}))
        plan = FaultPlan(path, check_every_s=0.0, sleep=lambda s: None)
        return FaultyStore(make_store(), plan, who="pe0", timeout_s=5.0)

    return make


def test_reads_into_pinned_slots_equal_reads_into_numpy(faulty, random_blocks, fmt):
    store = faulty([{"op": "store.read", "delay_s": 0.5, "count": 2}])  # the first two wait
    assert store.read_destinations == store.inner.read_destinations
    keys = block_keys(range(12), 4, fmt.fingerprint)
    store.write_full(keys, random_blocks(3, seed=3)).result()
    host = store.read_full(keys).result().stack()
    pool = HostBufferPool(fmt.layout, 3, "DE buffer")
    with pool.reserve(3) as res:
        assert store.read_full(keys, buffer_destination(res)).result().hits == 3
        assert np.stack(res.blocks()).tobytes() == host.tobytes()
        for i in range(3):
            res.block(i)[...] = 0
        for layer in range(fmt.layout.num_layers):
            got = store.read_layers(keys, (layer, layer + 1), buffer_destination(res)).result()
            assert got.hits == 3
        assert np.stack(res.blocks()).tobytes() == host.tobytes()
    assert sum(store.plan.injected.values()) == 2


def test_a_read_fault_fails_a_pinned_read(faulty, random_blocks, fmt):
    store = faulty([{"op": "store.read", "error": "EIO", "count": 1}])
    keys = block_keys(range(8), 4, fmt.fingerprint)
    store.write_full(keys, random_blocks(2)).result()
    pool = HostBufferPool(fmt.layout, 2, "PE buffer")
    with pool.reserve(2) as res:
        with pytest.raises(StoreError, match="injected"):
            store.read_full(keys, buffer_destination(res)).result()
        assert (np.stack(res.blocks()) == 0).all()  # the read never reached the store


def test_device_destination_is_refused(faulty, fmt):
    store = faulty()
    assert DestinationKind.DEVICE not in store.read_destinations
    lay = fmt.layout
    pages = jnp.zeros((lay.num_layers, 2, *lay.shape[1:]), jnp.uint8)
    keys = block_keys(range(4), 4, fmt.fingerprint)
    with pytest.raises(UnsupportedDestination, match="not supported by this store"):
        store.read_full(keys, DeviceDestination(pages, (0,)))
