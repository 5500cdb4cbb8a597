"""Helpers shared by the prefill and decode engines."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from dualpath_jax.engine import messages as M
from dualpath_jax.kvstore.store import StoreError
from dualpath_jax.transfer.channel import TransferError
from dualpath_jax.transfer.loader import LoadJob
from dualpath_jax.transfer.readiness import LoadCancelled, LoadTimeout


def job_from_msg(m: M.LoadJobMsg) -> LoadJob:
    return LoadJob(
        request_id=m.request,
        keys=tuple(m.keys),
        pe_blocks=m.pe_blocks,
        de_blocks=m.de_blocks,
        prompt_tokens=len(m.prompt),
        pe_engine=f"pe{m.pe_engine}",
        pe_node=f"node{m.pe_node}",
        de_engine=f"de{m.de_engine}",
        de_node=f"node{m.de_node}",
        pe_address=m.pe_address,
        de_address=m.de_address,
        oracle=m.oracle,
        attempt=m.attempt,
    )


log = logging.getLogger(__name__)


def register(
    rpc, role: str, engine: int, node: int, group: int, address: str, params_version: str = ""
) -> None:
    """Announces an engine (its KV channel address and served params version) to the router."""
    rpc.send(
        M.Register(
            role=role,
            engine=engine,
            node=node,
            group=group,
            address=address,
            pid=os.getpid(),
            params_version=params_version,
        )
    )


def pump(rpc, handle: Callable[[M.Msg], None], timeout_ms: int) -> None:
    """Handles every message waiting on `rpc` (waiting up to `timeout_ms` for the first)."""
    msg = rpc.recv(timeout_ms)
    while msg is not None:
        handle(msg)
        msg = rpc.recv(0)


def is_stop(msg: M.Msg) -> bool | None:
    """The messages every engine treats alike: True for a stop order, False for one to ignore
    (acks, stats, logged router errors), None for an engine-specific message."""
    match msg:
        case M.Stop() | M.Error(kind="stop"):
            return True
        case M.Ack() | M.Stats():
            return False
        case M.Error(message=text):
            log.warning("router error: %s", text)
            return False
    return None


def failed(request: str, engine: int, exc: BaseException) -> M.Failed:
    """The `Failed` report of an engine's part of a request, classified by `failure_kind`."""
    log.warning("request %s failed: %s", request, exc)
    return M.Failed(
        request=request,
        engine=engine,
        message=f"{type(exc).__name__}: {exc}",
        kind=failure_kind(exc),
    )


def failure_kind(exc: BaseException) -> str:
    """How the router should treat a failure: `transfer` (a peer vanished or stalled: retry),
    `store` (the block store failed: report), or `error`."""
    if isinstance(exc, TransferError | LoadTimeout | LoadCancelled | TimeoutError):
        return "transfer"
    if isinstance(exc, StoreError):
        return "store"
    return "error"


class HeartbeatThread(threading.Thread):
    """Sends `Heartbeat` to the router every `interval_s` on a socket of its own (zmq sockets are
    per thread), independent of the engine loop, which may block in a compile or a forward."""

    def __init__(self, address: str, token: str, engine: int, interval_s: float):
        super().__init__(name=f"heartbeat-{engine}", daemon=True)
        self.address, self.token, self.engine, self.interval_s = address, token, engine, interval_s
        self._halt = threading.Event()

    def run(self) -> None:
        from dualpath_jax.engine.rpc import RpcClient

        rpc = RpcClient(self.address, self.token)
        try:
            while not self._halt.wait(self.interval_s):
                rpc.send(M.Heartbeat(engine=self.engine))
                while rpc.recv(0) is not None:  # the router does not answer heartbeats; drain
                    pass
        finally:
            rpc.close()

    def stop(self) -> None:
        self._halt.set()
