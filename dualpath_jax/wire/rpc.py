"""ZeroMQ transport for control messages: a ROUTER server (the router) and DEALER clients.

Sockets are used from one thread each (zmq sockets are not thread safe). The server binds to
loopback unless told otherwise; binding anywhere else requires the secrets (engine and client
roles, wire/credentials.py), one of which every frame then carries. Bad frames are answered
with `Error` and dropped; the server keeps serving. That `Error` goes out without a token (a peer
that failed the checks must not learn one); clients accept such a tokenless `Error` (kind `auth`
or `frame`) and nothing else unsigned.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
from collections.abc import Mapping
from typing import NamedTuple

import zmq

from dualpath_jax.config import ConfigError
from dualpath_jax.wire import frames, messages

log = logging.getLogger(__name__)

_MAX_PEERS = 65_536  # peers whose role the server remembers (the oldest are forgotten first)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, tokens: Mapping[str, str] | None) -> None:
    if not is_loopback(host) and not tokens:
        raise ConfigError(
            f"binding the control plane to {host!r} (not loopback) needs cluster.secrets_file"
        )


def check_transfer_bind(host: str, untrusted_network_ok: bool) -> None:
    """The KV transfer server has no authentication and aborts on malformed input (an upstream
    limitation of `jax.experimental.transfer`), so it binds to loopback or to a private
    address (the cluster's own network); a wildcard or public bind must be asked for."""
    if is_loopback(host):
        return
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is not None and ip.is_private and not ip.is_unspecified:
        log.warning(
            "the KV transfer server listens on %s: it is unauthenticated; keep that network "
            "closed to anything but this cluster (docs/failures.md)",
            host,
        )
        return
    if ip is None:
        what = "a host name, not an IP"  # its address is unknown here, so it cannot be checked
    else:
        what = "a wildcard" if ip.is_unspecified else "a non-private"
    if not untrusted_network_ok:
        raise ConfigError(
            f"cluster.transfer_host={host!r} is {what} address, but the KV transfer server is "
            "unauthenticated and crashes on malformed input: bind it to loopback or the "
            "cluster's private interface, or set cluster.transfer_untrusted_network_ok=true"
        )
    log.warning(
        "the unauthenticated KV transfer server listens on %s (%s address): anyone who reaches "
        "it can crash this engine",
        host,
        what,
    )


def bracketed(host: str) -> str:
    """`host`, an IPv6 literal in brackets (as `host:port` and URLs need it)."""
    return f"[{host}]" if ":" in host else host


def host_port(host: str, port: int) -> str:
    """`host:port`, bracketing IPv6 literals."""
    return f"{bracketed(host)}:{port}"


class Incoming(NamedTuple):
    ident: bytes  # the peer's socket identity (where answers go)
    msg: messages.Msg
    role: str  # whose secret the frame carried: frames.ENGINE or frames.CLIENT


class RpcServer:
    """ROUTER socket. `recv` yields `Incoming(peer identity, message, role)`; `send` answers one
    peer. `tokens` maps each role to its secret; with none, every peer has the engine role (only
    allowed on loopback). A peer's answers carry its own role's secret (the envelope holds the
    token in clear, so a client never sees the engine secret); a peer never heard from gets the
    client secret."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        tokens: Mapping[str, str] | None = None,
        *,
        endpoint: str = "",
    ):
        """`endpoint`: an `inproc://name` endpoint to bind instead of `host`/`port` (peers in
        this process only: an in-process cluster)."""
        if endpoint and not endpoint.startswith("inproc://"):
            raise ValueError(f"endpoint must be an inproc:// one, not {endpoint!r}")
        if not endpoint:
            check_bind(host, tokens)
        self.tokens = dict(tokens or {})
        self._roles: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self._ctx = zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, frames.MAX_FRAME_BYTES)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.sock.setsockopt(zmq.IPV6, 1)  # else ZeroMQ refuses IPv6 endpoints
        if endpoint:
            self.sock.bind(endpoint)
            self.address = endpoint
        else:
            if port:
                self.sock.bind(f"tcp://{host_port(host, port)}")
            else:
                port = self.sock.bind_to_random_port(f"tcp://{bracketed(host)}")
            self.address = f"tcp://{host_port(host, port)}"
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.rejected = 0

    def recv(self, timeout_ms: int) -> Incoming | None:
        """One message, or None after `timeout_ms` (or after rejecting a bad frame)."""
        if not self.poller.poll(timeout_ms):
            return None
        parts = self.sock.recv_multipart(zmq.NOBLOCK)
        ident, payload = parts[0], parts[-1]
        try:
            msg, role = frames.decode_role(payload, self.tokens)
        except frames.FrameError as e:
            self.rejected += 1
            log.warning("rejected a frame: %s", e)
            kind = "auth" if isinstance(e, frames.AuthError) else "frame"
            # Envelopes carry the token in clear, so a peer that failed the checks gets none.
            self._send_frame(
                ident, frames.encode(messages.Error(ref="", message=str(e), kind=kind), "")
            )
            return None
        self._roles[ident] = role
        self._roles.move_to_end(ident)
        if len(self._roles) > _MAX_PEERS:
            self._roles.popitem(last=False)
        return Incoming(ident, msg, role)

    def send(self, ident: bytes, msg: messages.Msg) -> None:
        role = self._roles.get(ident, frames.CLIENT)
        self._send_frame(ident, frames.encode(msg, self.tokens.get(role, "")))

    def _send_frame(self, ident: bytes, frame: bytes) -> None:
        try:
            self.sock.send_multipart([ident, frame], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("dropped a message to a peer that is not reading")

    def close(self) -> None:
        self.sock.close(0)


class RpcClient:
    """DEALER socket connected to a server address."""

    def __init__(self, address: str, token: str = "", identity: bytes | None = None):
        self.token = token
        self._ctx = zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, frames.MAX_FRAME_BYTES)
        self.sock.setsockopt(zmq.IPV6, 1)  # to reach tcp://[v6]:port too
        if identity:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(address)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)

    def send(self, msg: messages.Msg) -> None:
        """Raises `FrameError` for a message that cannot be encoded or is over the size limit."""
        self.sock.send(frames.encode(msg, self.token))

    def send_frame(self, frame: bytes) -> None:
        self.sock.send(frame)

    def recv(self, timeout_ms: int) -> messages.Msg | None:
        """The next message; a tokenless `Error` from the server (our frame was rejected, e.g.
        for a wrong secret) is returned too, any other frame that fails the checks raises."""
        if not self.poller.poll(timeout_ms):
            return None
        frame = self.sock.recv(zmq.NOBLOCK)
        try:
            return frames.decode(frame, self.token)
        except frames.AuthError:
            err = frames.decode_unsigned_error(frame) if self.token else None
            if err is None:
                raise
            return err

    def call(self, msg: messages.Msg, timeout_ms: int = 30_000) -> messages.Msg:
        """Sends and waits for the next message (only for sockets with one outstanding call)."""
        self.send(msg)
        reply = self.recv(timeout_ms)
        if reply is None:
            raise TimeoutError(f"no reply to {type(msg).__name__} within {timeout_ms} ms")
        return reply

    def close(self) -> None:
        self.sock.close(0)
