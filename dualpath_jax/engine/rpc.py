"""ZeroMQ transport for control messages: a ROUTER server (the router) and DEALER clients.

Sockets are used from one thread each (zmq sockets are not thread safe). The server binds to
loopback unless told otherwise; binding anywhere else requires a shared token, which every frame
then carries. Bad frames are answered with `Error` and dropped; the server keeps serving. That
`Error` goes out without the token (a peer that failed the checks must not learn it), so a
client holding a token reads it as a FrameError.
"""

from __future__ import annotations

import ipaddress
import logging

import zmq

from dualpath_jax.config import ConfigError
from dualpath_jax.engine import messages as M

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str) -> None:
    if not is_loopback(host) and not token:
        raise ConfigError(
            f"binding the control plane to {host!r} (not loopback) needs cluster.auth_token"
        )


class RpcServer:
    """ROUTER socket. `recv` yields (peer identity, message); `send` answers one peer."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str = ""):
        check_bind(host, token)
        self.token = token
        self._ctx = zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, M.MAX_FRAME_BYTES)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.rejected = 0

    def recv(self, timeout_ms: int) -> tuple[bytes, M.Msg] | None:
        """One message, or None after `timeout_ms` (or after rejecting a bad frame)."""
        if not self.poller.poll(timeout_ms):
            return None
        frames = self.sock.recv_multipart(zmq.NOBLOCK)
        ident, payload = frames[0], frames[-1]
        try:
            return ident, M.decode(payload, self.token)
        except M.FrameError as e:
            self.rejected += 1
            log.warning("rejected a frame: %s", e)
            # Envelopes carry the token in clear, so a peer that failed the checks gets none.
            self._send_frame(ident, M.encode(M.Error(ref="", message=str(e), kind="frame"), ""))
            return None

    def send(self, ident: bytes, msg: M.Msg) -> None:
        self._send_frame(ident, M.encode(msg, self.token))

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
        self.sock.setsockopt(zmq.MAXMSGSIZE, M.MAX_FRAME_BYTES)
        if identity:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(address)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)

    def send(self, msg: M.Msg) -> None:
        self.sock.send(M.encode(msg, self.token))

    def recv(self, timeout_ms: int) -> M.Msg | None:
        if not self.poller.poll(timeout_ms):
            return None
        return M.decode(self.sock.recv(zmq.NOBLOCK), self.token)

    def call(self, msg: M.Msg, timeout_ms: int = 30_000) -> M.Msg:
        """Sends and waits for the next message (only for sockets with one outstanding call)."""
        self.send(msg)
        reply = self.recv(timeout_ms)
        if reply is None:
            raise TimeoutError(f"no reply to {type(msg).__name__} within {timeout_ms} ms")
        return reply

    def close(self) -> None:
        self.sock.close(0)
