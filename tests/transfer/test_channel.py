"""KVChannel conformance: one suite over JaxTransferChannel (peer in another process) and
InProcessChannel (peer on the same InProcessFabric), plus the pure helpers."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dualpath_jax.transfer.channel import (
    KVChannel,
    TransferError,
    TransferTimeout,
    batch_layer_blocks,
    make_uuid,
    pack_layer_blocks,
    packed_spec,
    unpack_layer_blocks,
)
from dualpath_jax.transfer.inprocess_channel import InProcessChannel, InProcessFabric
from dualpath_jax.transfer.jax_channel import JaxTransferChannel

_PEER_SCRIPT = pathlib.Path(__file__).with_name("channel_peer.py")
_spec = importlib.util.spec_from_file_location("channel_peer", _PEER_SCRIPT)
channel_peer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(channel_peer)
make_array = channel_peer.make_array

REPO = pathlib.Path(__file__).resolve().parents[2]


# --- peers: something that offers arrays under uuids at an address, and can die --------------


class LocalPeer:
    """A peer channel on the receiver's fabric."""

    def __init__(self, fabric: InProcessFabric):
        self.fabric = fabric
        self.channel = InProcessChannel(fabric, "peer")
        self.address = self.channel.address

    def offer(self, uuid: int, items: list[tuple[int, tuple[int, ...], str]]) -> None:
        self.channel.offer(uuid, [make_array(*item) for item in items])

    def kill(self) -> None:
        self.fabric.kill(self.address)


class ProcessPeer:
    """A peer engine process (tests/transfer/channel_peer.py); its stderr goes to `log`."""

    def __init__(self, log: pathlib.Path):
        self.log = log
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
        with open(log, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(_PEER_SCRIPT)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
                cwd=REPO,
            )
        line = self.proc.stdout.readline()
        if not line.startswith("ADDR "):
            self.kill()
            raise RuntimeError(f"peer did not start ({line!r}); log: {self._log_tail()}")
        self.address = line.split()[1]

    def _log_tail(self) -> str:
        return self.log.read_text()[-2000:] if self.log.exists() else ""

    def offer(self, uuid: int, items: list[tuple[int, tuple[int, ...], str]]) -> None:
        words = " ".join(channel_peer.encode_item(*item) for item in items)
        self.proc.stdin.write(f"offer {uuid} {words}\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline().strip()
        assert reply == "OK", f"peer: {reply!r}; log: {self._log_tail()}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class Env:
    """A receiver channel, a shared live peer, a way to start a disposable peer, a dead address."""

    def __init__(self, kind, receiver, peer, new_peer, dead_address, new_channel):
        self.kind = kind
        self.receiver: KVChannel = receiver
        self.peer = peer
        self.new_peer = new_peer
        self.dead_address = dead_address
        self.new_channel = new_channel


@pytest.fixture(
    scope="module", params=["inprocess", pytest.param("jax", marks=pytest.mark.multiprocess)]
)
def env(request, tmp_path_factory):
    if request.param == "inprocess":
        fabric = InProcessFabric()
        receiver = InProcessChannel(fabric, "receiver")
        peers = [LocalPeer(fabric)]
        yield Env(
            "inprocess",
            receiver,
            peers[0],
            lambda: LocalPeer(fabric),
            "inproc://nobody-0",
            lambda: InProcessChannel(fabric, "extra"),
        )
        receiver.close()
        return
    logs = tmp_path_factory.mktemp("peers")
    started: list[ProcessPeer] = []

    def new_peer() -> ProcessPeer:
        p = ProcessPeer(logs / f"peer{len(started)}.log")
        started.append(p)
        return p

    receiver = JaxTransferChannel()
    try:
        yield Env("jax", receiver, new_peer(), new_peer, "127.0.0.1:1", JaxTransferChannel)
    finally:
        receiver.close()
        for p in started:
            p.kill()


_counter = iter(range(1, 1 << 30))


def fresh_uuid() -> int:
    return make_uuid("test_channel", next(_counter))


def specs_of(items):
    return [(shape, dtype) for _, shape, dtype in items]


def assert_same(got: list[jax.Array], items) -> None:
    assert len(got) == len(items)
    for g, item in zip(got, items):
        want = make_array(*item)
        assert isinstance(g, jax.Array)
        assert g.shape == want.shape and np.dtype(g.dtype) == want.dtype
        assert np.asarray(g).tobytes() == want.tobytes()


# --- conformance ---------------------------------------------------------------------------


def test_uuids_pulled_in_any_order_get_their_arrays(env):
    offers = {}
    for k, items in enumerate(
        [
            [(1, (1, 8, 32), "uint8")],
            [(2, (1, 8, 32), "uint8"), (3, (1, 8, 32), "uint8")],
            [(4, (5,), "float32")],
            [(5, (3, 8, 32), "uint8"), (6, (7,), "int16")],
        ]
    ):
        u = fresh_uuid()
        env.peer.offer(u, items)
        offers[k] = (u, items)
    for k in [2, 0, 3, 1]:
        u, items = offers[k]
        assert_same(env.receiver.pull(env.peer.address, u, specs_of(items), timeout_s=10), items)

    batch = []
    for k in range(6):
        u, items = fresh_uuid(), [(100 + k, (1, 16, 64), "uint8")]
        env.peer.offer(u, items)
        batch.append((u, items))
    futures = [
        (env.receiver.pull_async(env.peer.address, u, specs_of(items), 10), items)
        for u, items in reversed(batch)
    ]
    for fut, items in futures:
        assert_same(fut.result(timeout=20), items)


def test_large_and_tiny_arrays_are_byte_identical(env):
    before = env.receiver.stats
    items = [(7, (1, 2048, 16384), "uint8")]  # 32 MiB
    tiny = [(8, (3,), "uint8"), (9, (1,), "float16"), (10, (2,), "int8")]
    u_big, u_tiny = fresh_uuid(), fresh_uuid()
    env.peer.offer(u_big, items)
    env.peer.offer(u_tiny, tiny)
    assert_same(env.receiver.pull(env.peer.address, u_big, specs_of(items), 30), items)
    assert_same(env.receiver.pull(env.peer.address, u_tiny, specs_of(tiny), 10), tiny)
    after = env.receiver.stats
    assert after.pulls == before.pulls + 2
    assert after.bytes_pulled - before.bytes_pulled == (32 << 20) + 3 + 2 + 2


def test_unknown_uuid_times_out_and_channel_stays_usable(env):
    before = env.receiver.stats
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout):
        env.receiver.pull(env.peer.address, fresh_uuid(), [((4,), "uint8")], timeout_s=0.3)
    assert time.monotonic() - t0 >= 0.3  # it waited out its timeout (a floor: load cannot break it)
    assert env.receiver.stats.timeouts == before.timeouts + 1

    fut = env.receiver.pull_async(env.peer.address, fresh_uuid(), [((4,), "uint8")], 0.3)
    with pytest.raises(TransferTimeout):
        fut.result(timeout=5)

    items = [(11, (1, 4, 8), "uint8")]
    u = fresh_uuid()
    env.peer.offer(u, items)
    assert_same(env.receiver.pull(env.peer.address, u, specs_of(items), 10), items)


def test_pull_issued_before_the_offer_waits_for_it(env):
    items = [(19, (1, 16, 32), "uint8")]
    u = fresh_uuid()
    fut = env.receiver.pull_async(env.peer.address, u, specs_of(items), 10)
    time.sleep(0.2)
    assert not fut.done()
    env.peer.offer(u, items)
    assert_same(fut.result(timeout=15), items)


def test_each_uuid_is_pulled_once(env):
    items = [(12, (6,), "uint8")]
    u = fresh_uuid()
    env.peer.offer(u, items)
    assert_same(env.receiver.pull(env.peer.address, u, specs_of(items), 10), items)
    with pytest.raises(TransferTimeout):
        env.receiver.pull(env.peer.address, u, specs_of(items), timeout_s=0.3)


def test_wrong_size_spec_is_a_transfer_error(env):
    u = fresh_uuid()
    env.peer.offer(u, [(13, (16,), "uint8")])
    with pytest.raises(TransferError):
        env.receiver.pull(env.peer.address, u, [((32,), "uint8")], timeout_s=5)
    items = [(14, (16,), "uint8")]
    u = fresh_uuid()
    env.peer.offer(u, items)
    assert_same(env.receiver.pull(env.peer.address, u, specs_of(items), 10), items)


def test_peer_killed_mid_transfer_fails_fast_with_transfer_error(env):
    peer = env.new_peer()
    try:
        items = [(15, (1, 8, 32), "uint8")]
        u = fresh_uuid()
        peer.offer(u, items)
        assert_same(env.receiver.pull(peer.address, u, specs_of(items), 10), items)

        # a generous timeout: failing fast shows as a TransferError that is not a timeout
        pending = env.receiver.pull_async(peer.address, fresh_uuid(), specs_of(items), 120)
        time.sleep(0.2)  # the pull is in flight, waiting on the peer
        peer.kill()
        with pytest.raises(TransferError) as info:
            pending.result(timeout=150)
        assert not isinstance(info.value, TransferTimeout)
        with pytest.raises(TransferError) as info:  # later pulls from the dead peer fail too
            env.receiver.pull(peer.address, fresh_uuid(), specs_of(items), timeout_s=120)
        assert not isinstance(info.value, TransferTimeout)
    finally:
        peer.kill()
    # The receiver still serves other peers.
    items = [(16, (3,), "uint8")]
    u = fresh_uuid()
    env.peer.offer(u, items)
    assert_same(env.receiver.pull(env.peer.address, u, specs_of(items), 10), items)


def test_pull_from_an_address_nobody_serves_is_a_transfer_error(env):
    with pytest.raises(TransferError) as info:
        env.receiver.pull(env.dead_address, fresh_uuid(), [((4,), "uint8")], timeout_s=120)
    assert not isinstance(info.value, TransferTimeout)  # refused, not waited out


def test_offer_side_accounting_and_closed_channel(env):
    sender = env.new_channel()
    with sender:
        items = [(17, (2, 8, 16), "uint8"), (18, (5,), "float32")]
        u = fresh_uuid()
        sender.offer(u, [make_array(*it) for it in items])
        sender.offer(fresh_uuid(), [jnp.zeros((4,), jnp.uint8)])  # jax arrays too
        with pytest.raises(ValueError):
            sender.offer(u, [make_array(*items[0])])
        with pytest.raises(ValueError):
            sender.offer(fresh_uuid(), [])
        s = sender.stats
        assert (s.offers, s.bytes_offered, s.outstanding_offers) == (2, 256 + 20 + 4, 2)
        assert_same(env.receiver.pull(sender.address, u, specs_of(items), 10), items)
        address = sender.address
    with pytest.raises(TransferError):
        sender.offer(fresh_uuid(), [make_array(*items[0])])
    with pytest.raises(TransferError) as info:  # a closed peer is gone, not just slow
        env.receiver.pull(address, fresh_uuid(), specs_of(items), timeout_s=120)
    assert not isinstance(info.value, TransferTimeout)


# --- pure helpers ----------------------------------------------------------------------------


def test_make_uuid_is_deterministic_distinct_and_63_bit():
    ids = {
        make_uuid(f"r{r}", layer, part, epoch=e)
        for r in range(20)
        for layer in range(-1, 30)
        for part in range(3)
        for e in range(2)
    }
    assert len(ids) == 20 * 31 * 3 * 2
    assert all(0 < i < 2**63 for i in ids)
    assert make_uuid("req-7", 3, 1) == make_uuid("req-7", 3, 1)
    assert make_uuid("req-7", 3, 1) != make_uuid("req-7", 3, 1, epoch=1)


def test_batch_layer_blocks_bounds_and_covers():
    assert batch_layer_blocks([10] * 7, 30) == [range(0, 3), range(3, 6), range(6, 7)]
    assert batch_layer_blocks([50, 10, 10], 30) == [range(0, 1), range(1, 3)]
    assert batch_layer_blocks([1] * 4) == [range(0, 4)]
    assert batch_layer_blocks([]) == []


@pytest.mark.parametrize("as_jax", [False, True])
def test_pack_unpack_layer_blocks_round_trip(as_jax):
    blocks = [make_array(20 + i, (1, 4, 12), "uint8") for i in range(5)]
    full = np.concatenate(blocks, axis=0)  # [n_layers, T, B]: the Full Block
    src = [jnp.asarray(b) for b in blocks] if as_jax else blocks
    packed = pack_layer_blocks(src)
    assert isinstance(packed, jax.Array if as_jax else np.ndarray)
    assert packed.shape == (5, 4, 12) and np.asarray(packed).tobytes() == full.tobytes()
    assert packed_spec([(b.shape, b.dtype) for b in blocks]) == ((5, 4, 12), np.dtype("uint8"))
    back = unpack_layer_blocks(packed, 5)
    assert [np.asarray(b).tobytes() for b in back] == [b.tobytes() for b in blocks]
    uneven = unpack_layer_blocks(packed, [2, 3])
    assert [b.shape[0] for b in uneven] == [2, 3]
    with pytest.raises(ValueError):
        unpack_layer_blocks(packed, 3)
    with pytest.raises(ValueError):
        pack_layer_blocks([blocks[0], make_array(0, (1, 4, 13), "uint8")])


def test_packed_transfer_round_trip_in_process():
    fabric = InProcessFabric()
    with InProcessChannel(fabric) as pe, InProcessChannel(fabric) as de:
        blocks = [make_array(40 + i, (1, 8, 24), "uint8") for i in range(6)]
        u = make_uuid("req", -1)
        pe.offer(u, [pack_layer_blocks(blocks)])
        spec = packed_spec([(b.shape, b.dtype) for b in blocks])
        (packed,) = de.pull(pe.address, u, [spec], timeout_s=5)
        got = unpack_layer_blocks(packed, len(blocks))
        assert [np.asarray(g).tobytes() for g in got] == [b.tobytes() for b in blocks]


@pytest.mark.ipv6
def test_jax_channels_on_an_ipv6_address():
    """`cluster.transfer_host` may be an IPv6 literal: the server listens on `[v6]:port`, says so
    in its address, and pulls from that address arrive."""
    sender = JaxTransferChannel(bind="[::1]:0", transport_addresses=["[::1]:0"])
    receiver = JaxTransferChannel(bind="[::1]:0", transport_addresses=["[::1]:0"])
    try:
        assert sender.address.startswith("[::1]:")
        items = [(16, (3, 5), "float32"), (17, (7,), "uint8")]
        u = fresh_uuid()
        sender.offer(u, [make_array(*item) for item in items])
        assert_same(receiver.pull(sender.address, u, specs_of(items), 10), items)
    finally:
        receiver.close()
        sender.close()
