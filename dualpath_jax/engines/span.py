"""Engines spanning several processes: one `jax.distributed` group per engine.

A model too large for one host's devices is served by an engine whose mesh spans the devices of
several processes (`cluster.prefill_processes` / `decode_processes`; the role's mesh covers all
of them). The processes form a `jax.distributed` group of their own: no other engine joins it,
so a crash there cannot take down another engine (a crash inside it ends the whole engine,
which the router then declares dead, as for any engine).

JAX runs such a mesh multi-controller: every process calls the same programs in the same order.
Process 0, the leader, is the engine the router knows (it registers, fetches work, owns the
buffer, the KV channel and the store) and sends the others, its followers, what to run, as
host data; a follower builds the same model on the same mesh and replays it (`follow`):
- a decode engine's `Decoder` is a `MirroredDecoder`: each call that touches the device (or
  state a later program depends on) goes to the followers, method name and host arguments,
  before it runs (`DecoderReplay` replays them on a decoder of the shape the first call gives);
- a prefill engine sends each forward batch and each layer's cached rows
  (`prefill_forward.PrefillReplay` runs the same forward).
Results the leader reads on the host (sampled tokens, logits, pages to persist, new rows) are
replicated over the mesh, so it reads its own copy.

The leader publishes on a ZeroMQ PUB socket bound on `cluster.host`, whose address reaches the
followers through the group's key-value store; frames are msgpack (no code is ever decoded).
The leader beats every second while idle; a follower that hears nothing for
`cluster.heartbeat_timeout_s` stops, as does one told to.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
import threading
import time
from typing import Any

import msgspec
import numpy as np
import zmq

from dualpath_jax.model.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# Decoder methods the followers replay (every other attribute is a host-side query of state
# these calls keep identical in every process).
MIRRORED = frozenset(
    {
        "insert",
        "insert_blocks",
        "free",
        "advance",
        "advance_many",
        "step",
        "set_next",
        "top_logprobs",
        "full_blocks",
        "rows",
        "warmup",
        "hold",
        "release",
        "fork",
    }
)
_ADDRESS_KEY = "dualpath/span/leader"
_READY_KEY = "dualpath/span/ready/{rank}"
_BEAT_S = 1.0


@dataclasses.dataclass(frozen=True)
class Span:
    """This process's place in its engine's group: `rank` of `size` processes, the group's
    `coordinator` (`host:port` of process 0's `jax.distributed` service)."""

    rank: int = 0
    size: int = 1
    coordinator: str = ""

    @property
    def spans(self) -> bool:
        return self.size > 1

    @property
    def leader(self) -> bool:
        return self.rank == 0


def init_distributed(
    span: Span, platform: str, *, bind_host: str = "127.0.0.1", timeout_s: float = 120.0
) -> None:
    """Joins this process to its engine's `jax.distributed` group (before anything else uses
    JAX). The coordinator (rank 0) listens on the coordinator address's host only, and on CPU
    the group's collectives (gloo) on `bind_host` (`cluster.transfer_host`), never on every
    interface. A process that stops beating is noticed after `timeout_s`."""
    import jax

    if platform == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        _gloo_on(bind_host)
    t = max(10, int(timeout_s))
    jax.distributed.initialize(
        coordinator_address=span.coordinator,
        num_processes=span.size,
        process_id=span.rank,
        initialization_timeout=t,
        heartbeat_timeout_seconds=t,
        shutdown_timeout_seconds=t,
        coordinator_bind_address=span.coordinator,
    )


def _gloo_on(host: str) -> None:
    """JAX makes its CPU client's gloo collectives with no host, and gloo then listens on the
    address this machine's name resolves to; this makes it listen on `host`."""
    from jax._src import xla_bridge

    make = xla_bridge._jax.make_gloo_tcp_collectives  # noqa: SLF001 - no public hook
    if getattr(make, "dualpath_host", None) == host:
        return
    base = getattr(make, "dualpath_base", make)

    def on_host(distributed_client, hostname=None, interface=None):
        return base(distributed_client=distributed_client, hostname=hostname or host)

    on_host.dualpath_host, on_host.dualpath_base = host, base
    xla_bridge._jax.make_gloo_tcp_collectives = on_host  # noqa: SLF001


def _kv_client():
    from jax._src import distributed  # the group's key-value store (no public handle yet)

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


def announce(key: str, value: str) -> None:
    """Puts `key` = `value` in this engine group's key-value store (e.g. a follower's KV
    channel address, which the leader reads with `MirrorLeader.kv_addresses`)."""
    _kv_client().key_value_set(key, value)


# ----------------------------------------------------------------------------- frames


# Frame extensions: a numpy array (dtype, shape, bytes); a `SamplingParams` (its own msgpack, so
# the follower gets the value back, not a map).
_ARRAY, _SAMPLING = 1, 2


def _enc_hook(x: Any) -> Any:
    if isinstance(x, np.ndarray):
        head = msgspec.msgpack.encode([x.dtype.str, list(x.shape)])
        data = np.ascontiguousarray(x).tobytes()
        return msgspec.msgpack.Ext(_ARRAY, struct.pack("<I", len(head)) + head + data)
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"cannot send {type(x).__name__} to a follower")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == _SAMPLING:
        return msgspec.msgpack.decode(data, type=SamplingParams)
    if code != _ARRAY:
        raise ValueError(f"unknown frame extension {code}")
    (n,) = struct.unpack_from("<I", data)
    dtype, shape = msgspec.msgpack.decode(data[4 : 4 + n])
    return np.frombuffer(data[4 + n :], dtype=np.dtype(dtype)).reshape(shape).copy()


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def _ext(x: Any) -> Any:
    if isinstance(x, SamplingParams):  # a struct encodes as a map without the hook
        return msgspec.msgpack.Ext(_SAMPLING, msgspec.msgpack.encode(x))
    return x


def encode_call(method: str, args: tuple, kwargs: dict) -> bytes:
    """One replayed call as a frame: `[method, args, kwargs]` (numpy arrays and sampling params
    as extensions)."""
    args = [_ext(a) for a in args]
    return _ENCODER.encode([method, args, {k: _ext(v) for k, v in kwargs.items()}])


def decode_call(frame: bytes) -> tuple[str, list, dict]:
    method, args, kwargs = _DECODER.decode(frame)
    return method, args, kwargs


# ----------------------------------------------------------------------------- leader


class MirrorLeader:
    """The leader's side: a PUB socket the followers subscribe to, one frame per call."""

    def __init__(self, span: Span, host: str = "127.0.0.1", timeout_s: float = 120.0):
        self.span, self.timeout_s = span, timeout_s
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.SNDHWM, 0)  # never drop a call
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.bind(f"tcp://{host}:0")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._closed = threading.Event()
        client = _kv_client()
        client.key_value_set(_ADDRESS_KEY, self.address)
        # PUB drops frames sent before a subscriber has joined: hello until every follower says
        # (through the group's key-value store) that one reached it.
        deadline = time.monotonic() + timeout_s
        waiting = set(range(1, span.size))
        while waiting:
            if time.monotonic() > deadline:
                raise TimeoutError(f"followers {sorted(waiting)} did not join in {timeout_s:.0f} s")
            self.sock.send(encode_call("_hello", (), {}))
            for rank in list(waiting):
                try:
                    client.key_value_try_get(_READY_KEY.format(rank=rank))
                except Exception:  # noqa: BLE001 - not there yet (NOT_FOUND)
                    continue
                waiting.discard(rank)
            time.sleep(0.05)
        self._beats = threading.Thread(target=self._beat, name="span-beat", daemon=True)
        self._beats.start()

    def kv_addresses(self, own: str) -> dict[int, str]:
        """Each process's KV channel address by rank (= process index): `own` for this one,
        the followers' as each put it in the group's key-value store."""
        from dualpath_jax.transfer.row_offers import KV_ADDRESS_KEY

        client, ms = _kv_client(), int(self.timeout_s * 1000)
        out = {0: own}
        for rank in range(1, self.span.size):
            out[rank] = client.blocking_key_value_get(KV_ADDRESS_KEY.format(rank=rank), ms)
        return out

    def send(self, method: str, args: tuple = (), kwargs: dict | None = None) -> None:
        frame = encode_call(method, args, kwargs or {})
        with self._lock:
            self.sock.send(frame)
            self._last = time.monotonic()

    def _beat(self) -> None:
        while not self._closed.wait(_BEAT_S / 4):
            if time.monotonic() - self._last >= _BEAT_S:
                self.send("_beat")

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self.send("_stop")
        with self._lock:
            self.sock.close()
        self.ctx.term()


class MirroredDecoder:
    """A `Decoder` whose device-touching calls are replayed by the followers first."""

    def __init__(self, decoder, leader: MirrorLeader):
        self._dec, self._leader = decoder, leader
        leader.send(
            "_init",
            (),
            {
                "slots": decoder.slots,
                "max_len": decoder.max_len,
                "min_bucket": decoder.min_bucket,
                "page_size": decoder.page_size,
                "num_pages": decoder.num_pages,
            },
        )

    def __getattr__(self, name: str):
        attr = getattr(self._dec, name)
        if name not in MIRRORED:
            return attr

        def call(*args, **kwargs):
            self._leader.send(name, args, kwargs)
            return attr(*args, **kwargs)

        return call


# ----------------------------------------------------------------------------- followers


class Follower:
    """A follower's end of the leader's calls: `recv()` is the next call, `(method, args,
    kwargs)`; beats and hellos are taken care of here. `recv` raises `Stopped` when the leader
    says stop or nothing arrives for `timeout_s` (the leader is gone). The leader's address is
    awaited longer, 4 x `timeout_s` (as long as the leader waits for its followers) and at
    least a minute: the leader builds its engine before it publishes one, and on a loaded host
    that ends well after the follower's own start."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.client = _kv_client()
        join_ms = int(max(4 * timeout_s, 60.0) * 1000)
        address = self.client.blocking_key_value_get(_ADDRESS_KEY, join_ms)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(address)
        self.ready = False
        self.calls = 0

    def recv(self) -> tuple[str, list, dict]:
        while True:
            if not self.sock.poll(int(self.timeout_s * 1000)):
                raise Stopped(f"no word from the leader for {self.timeout_s:.0f} s")
            method, args, kwargs = decode_call(self.sock.recv())
            if method == "_hello":
                if not self.ready:
                    self.client.key_value_set(_READY_KEY.format(rank=_rank()), "1")
                    self.ready = True
                continue
            if method == "_beat":
                continue
            if method == "_stop":
                raise Stopped(f"stopped by the leader after {self.calls} calls")
            self.calls += 1
            return method, args, kwargs

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


class Stopped(Exception):
    """The leader stopped (or went quiet): the follower ends."""


def follow(replay, *, timeout_s: float) -> None:
    """A follower's loop: `replay(follower, method, args, kwargs)` for each call of the leader
    until it stops (`DecoderReplay` for a decode engine, the prefill engine's replay)."""
    follower = Follower(timeout_s)
    try:
        while True:
            method, args, kwargs = follower.recv()
            replay(follower, method, args, kwargs)
    except Stopped as e:
        log.info("%s", e)
    finally:
        follower.close()


class DecoderReplay:
    """A decode engine's follower: builds the `Decoder` the leader's first call describes
    (`make_decoder(runner, **shape)`) and replays its calls."""

    def __init__(self, runner, make_decoder, params=None):
        from dualpath_jax.engines.params import ParamsSlot

        self.runner, self.make_decoder = runner, make_decoder
        self.decoder = None
        self.params = params or ParamsSlot(runner, "", -1)

    def __call__(self, follower: Follower, method: str, args: list, kwargs: dict) -> None:
        from dualpath_jax.engines.params import replay_params

        if replay_params(self.params, method, args):
            return
        if method == "_init":
            self.decoder = self.make_decoder(self.runner, **kwargs)
            return
        if self.decoder is None or method not in MIRRORED:
            raise RuntimeError(f"unexpected call {method!r} from the leader")
        getattr(self.decoder, method)(*args, **kwargs)


def _rank() -> int:
    import jax

    return jax.process_index()
