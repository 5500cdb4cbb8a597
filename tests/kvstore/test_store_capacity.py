"""A block store's default capacity: a fraction of its local disk's room (free bytes plus what
it holds at open), an explicit `capacity_bytes` wins, -1 is unlimited, and memory and remote
stores stay unlimited. Every disk here is a fake `disk_usage`: no test reads the real disk."""

from __future__ import annotations

import collections
import json
import logging

from dualpath_jax.config import StoreConfig
from dualpath_jax.kvstore import TensorStoreBlockStore, block_keys
from dualpath_jax.kvstore.capacity import local_root, store_capacity

Usage = collections.namedtuple("Usage", "total used free")
GIB = 2**30


class FakeDisk:
    """`shutil.disk_usage` of a disk with `free` bytes; records the paths it was asked about."""

    def __init__(self, free: int, total: int = 1000 * GIB):
        self.free, self.total, self.paths = free, total, []

    def __call__(self, path: str) -> Usage:
        self.paths.append(path)
        return Usage(self.total, self.total - self.free, self.free)


def _file(tmp_path, **kw) -> StoreConfig:
    return StoreConfig(kind="file", root=str(tmp_path / "store"), block_tokens=4, **kw)


def test_a_file_store_defaults_to_half_its_free_disk_and_logs_it(tmp_path, fmt, caplog):
    disk = FakeDisk(free=10 * GIB)
    with caplog.at_level(logging.INFO, logger="dualpath_jax.kvstore.store"):
        store = TensorStoreBlockStore(_file(tmp_path), fmt, disk_usage=disk)
    try:
        assert store.stats().capacity_bytes == 5 * GIB
        assert disk.paths and disk.paths[0].startswith(str(tmp_path / "store"))
        assert "block store capacity: 5.00 GiB (store.capacity_fraction=0.5" in caplog.text
    finally:
        store.close()


def test_the_fraction_counts_the_blocks_the_store_holds_at_open(tmp_path, fmt, random_blocks):
    keys = block_keys(range(40), 4, fmt.fingerprint)
    with TensorStoreBlockStore(_file(tmp_path), fmt, disk_usage=FakeDisk(GIB)) as store:
        store.write_full(keys, random_blocks(10)).result()
    held = 10 * fmt.encoded_bytes
    # A restart: its own blocks took part of the free space; the bound stays what it was.
    cfg = _file(tmp_path, capacity_fraction=0.25)
    with TensorStoreBlockStore(cfg, fmt, disk_usage=FakeDisk(GIB - held)) as store:
        assert store.stats().capacity_bytes == GIB // 4
        assert store.stats().bytes == held


def test_an_explicit_capacity_wins_and_minus_one_is_unlimited(tmp_path, fmt, random_blocks):
    disk = FakeDisk(free=10 * GIB)
    with TensorStoreBlockStore(_file(tmp_path, capacity_bytes=12345), fmt, disk_usage=disk) as st:
        assert st.stats().capacity_bytes == 12345
    with TensorStoreBlockStore(_file(tmp_path, capacity_bytes=-1), fmt, disk_usage=disk) as st:
        assert st.stats().capacity_bytes == 0  # the index's "no bound"
        keys = block_keys(range(40), 4, fmt.fingerprint)
        assert st.write_full(keys, random_blocks(10)).result().written == 10
    assert disk.paths == []  # neither looked at the disk


def test_a_small_disk_bounds_the_store_and_evicts(tmp_path, fmt, random_blocks):
    disk = FakeDisk(free=8 * fmt.encoded_bytes)  # room for 4 blocks at the default 0.5
    with TensorStoreBlockStore(_file(tmp_path), fmt, disk_usage=disk) as store:
        keys = block_keys(range(40), 4, fmt.fingerprint)
        blocks = random_blocks(10)
        for i in range(10):  # one round's persist after another
            store.write_full(keys[i : i + 1], blocks[i : i + 1]).result()
        st = store.stats()
        assert st.capacity_bytes == 4 * fmt.encoded_bytes
        assert st.blocks == 4 and st.evictions == 6


def test_memory_and_remote_stores_stay_unlimited_with_a_warning_for_remote(fmt, caplog):
    disk = FakeDisk(free=GIB)
    with TensorStoreBlockStore(
        StoreConfig(kind="memory", block_tokens=4), fmt, disk_usage=disk
    ) as st:
        assert st.stats().capacity_bytes == 0
    remote = {"driver": "gcs", "bucket": "kv"}
    with caplog.at_level(logging.WARNING, logger="dualpath_jax.kvstore.capacity"):
        cap = store_capacity(
            StoreConfig(kind="spec", spec_json=json.dumps(remote)), remote, 0, disk
        )
    assert cap.nbytes == 0 and "remote" in cap.why
    assert "store.capacity_bytes" in caplog.text
    assert disk.paths == []
    bounded = StoreConfig(kind="spec", capacity_bytes=GIB)
    assert store_capacity(bounded, remote, 0, disk).nbytes == GIB


def test_local_roots_of_specs():
    assert local_root("file", {"driver": "file", "path": "/d/store/"}) == "/d/store/"
    assert local_root("spec", "file:///d/s/") == "/d/s/"
    assert local_root("spec", {"driver": "ocdbt", "base": "file:///d/o/"}) == "/d/o/"
    assert local_root("spec", "gs://bucket/kv/") is None
    assert local_root("spec", {"driver": "s3", "bucket": "b"}) is None
    assert local_root("memory", {"driver": "memory"}) is None


def test_a_disk_that_cannot_be_read_leaves_the_store_unlimited(tmp_path, fmt):
    def broken(path):
        raise OSError("no such device")

    cap = store_capacity(_file(tmp_path), {"driver": "file", "path": str(tmp_path)}, 0, broken)
    assert cap.nbytes == 0 and "unknown" in cap.why
