"""`PrefetchMemory`, a DE's tool-gap prefetch memory: reads the blocks asked, in order, within
its budget, never while a round of the engine reads the store, and hands a load only the
blocks whose keys it wants."""

from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
import pytest

from dualpath_jax.config import StoreConfig
from dualpath_jax.kvstore.identity import KEY_HEX_CHARS
from dualpath_jax.kvstore.store import open_block_store
from dualpath_jax.model.layout import BlockLayout
from dualpath_jax.presets.models import TINY_QWEN2
from dualpath_jax.transfer.prefetch_memory import PrefetchMemory

BT = 16


@pytest.fixture
def store(tmp_path):
    with open_block_store(
        StoreConfig(root=str(tmp_path / "kv"), block_tokens=BT), TINY_QWEN2
    ) as st:
        yield st


@pytest.fixture
def layout():
    return BlockLayout.for_model(TINY_QWEN2, BT)


def put_blocks(store, layout, n: int, tag: str = "k") -> tuple[list[str], list[np.ndarray]]:
    keys = [key(f"{tag}{i}") for i in range(n)]
    blocks = [np.full(layout.shape, i + 1, np.uint8) for i in range(n)]
    store.write_full(keys, np.stack(blocks)).result(30)
    return keys, blocks


def key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:KEY_HEX_CHARS]


class Reports:
    def __init__(self):
        self.got: list[tuple[str, int, int]] = []
        self.event = threading.Event()

    def __call__(self, session: str, epoch: int, blocks: int, read_s: float) -> None:
        assert read_s >= 0
        self.got.append((session, epoch, blocks))
        self.event.set()

    def wait(self) -> tuple[str, int, int]:
        assert self.event.wait(30), "the prefetch never reported"
        return self.got[-1]


def test_reads_every_block_asked_and_a_load_takes_them(store, layout):
    keys, blocks = put_blocks(store, layout, 5)
    charged: list[int] = []
    mem = PrefetchMemory(store, layout, 10 * layout.nbytes, charge=charged.append)
    done = Reports()
    assert mem.start("s", keys, 7, done) == 5
    assert done.wait() == ("s", 7, 5)
    assert charged == [layout.nbytes] * 5  # each block on the node's storage links
    took = mem.take("s", keys)
    assert [b.tobytes() for b in took] == [b.tobytes() for b in blocks]
    assert mem.take("s", keys) == []  # taken once; its memory is free again
    assert mem.reserved_blocks() == 0
    mem.close()


def test_the_budget_bounds_what_is_read(store, layout):
    keys, _ = put_blocks(store, layout, 6)
    mem = PrefetchMemory(store, layout, 4.5 * layout.nbytes)
    done = Reports()
    assert mem.start("a", keys[:3], 1, done) == 3
    assert done.wait() == ("a", 1, 3)
    other = Reports()
    assert mem.start("b", keys[3:], 2, other) == 1  # 4 blocks of budget, 3 held by "a"
    assert other.wait() == ("b", 2, 1)
    mem.drop("a")
    assert mem.reserved_blocks() == 1
    mem.close()


def test_a_load_takes_only_the_leading_blocks_whose_keys_it_wants(store, layout):
    keys, blocks = put_blocks(store, layout, 4)
    mem = PrefetchMemory(store, layout, 10 * layout.nbytes)
    done = Reports()
    mem.start("s", keys, 1, done)
    done.wait()
    wanted = keys[:2] + [key("changed")] + keys[3:]  # the context changed after block 2
    took = mem.take("s", wanted)
    assert [b.tobytes() for b in took] == [b.tobytes() for b in blocks[:2]]
    assert mem.take("other", keys) == []
    mem.close()


def test_a_block_missing_from_the_store_ends_the_reads(store, layout):
    keys, _ = put_blocks(store, layout, 3)
    mem = PrefetchMemory(store, layout, 10 * layout.nbytes)
    done = Reports()
    mem.start("s", keys[:2] + [key("missing")] + keys[2:], 1, done)
    assert done.wait() == ("s", 1, 2)
    assert mem.reserved_blocks() == 2  # the rest of the reservation is freed
    mem.close()


def test_no_block_is_read_while_a_round_reads_the_store(store, layout):
    keys, _ = put_blocks(store, layout, 3)
    mem = PrefetchMemory(store, layout, 10 * layout.nbytes)
    done = Reports()
    with mem.critical():
        mem.start("s", keys, 1, done)
        time.sleep(0.3)  # the reader had time to start: it waits for the round's reads
        assert mem.read_blocks == 0 and not done.event.is_set()
    assert done.wait() == ("s", 1, 3)
    assert mem.read_blocks == 3
    mem.close()


def test_a_dropped_prefetch_stops_and_never_reports(store, layout):
    keys, _ = put_blocks(store, layout, 3)
    mem = PrefetchMemory(store, layout, 10 * layout.nbytes)
    done = Reports()
    with mem.critical():  # the reader waits at its first block
        mem.start("s", keys, 1, done)
        mem.drop("s", epoch=2)  # another epoch: kept
        assert mem.reserved_blocks() == 3
        mem.drop("s", epoch=1)
    assert mem.reserved_blocks() == 0
    later = Reports()
    mem.start("t", keys, 3, later)  # the reader is free again, one prefetch after the other
    assert later.wait() == ("t", 3, 3)
    assert done.got == [] and mem.read_blocks == 3
    mem.close()
