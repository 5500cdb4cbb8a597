"""Helpers shared by the prefill and decode engines."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence

from dualpath_jax.engines.params import ParamsMismatch
from dualpath_jax.kvstore.store import StoreError
from dualpath_jax.transfer.channel import TransferError
from dualpath_jax.transfer.loader import LoadJob
from dualpath_jax.transfer.prefetch_memory import PrefetchMemory
from dualpath_jax.transfer.readiness import LoadCancelled, LoadTimeout
from dualpath_jax.transfer.traffic import TrafficManager
from dualpath_jax.wire import frames, messages


def job_from_msg(m: messages.LoadJobMsg) -> LoadJob:
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
        pe_pieces=m.pe_pieces,
        pe_piece_addresses=tuple(m.pe_piece_addresses),
        pe_piece_holders=tuple(tuple(h) for h in m.pe_piece_holders),
        lead=m.lead_blocks,
        session=m.session,
    )


log = logging.getLogger(__name__)


def prefetch_order(
    msg: messages.Prefetch | messages.DropPrefetch,
    memory: PrefetchMemory | None,
    engine: int,
    put: Callable[[messages.Msg], object],
) -> None:
    """Carries out a router's tool-gap `Prefetch` or `DropPrefetch` on an engine's prefetch
    `memory` (a PE's or a DE's); `Prefetched` goes back through `put` (thread-safe: the reader
    thread reports). An engine without a memory answers that it holds nothing."""

    def done(session: str, epoch: int, blocks: int, read_s: float) -> None:
        put(
            messages.Prefetched(
                engine=engine, session=session, epoch=epoch, blocks=blocks, read_s=read_s
            )
        )

    if isinstance(msg, messages.DropPrefetch):
        if memory is not None:
            memory.drop(msg.session, msg.epoch)
    elif memory is None:
        done(msg.session, msg.epoch, 0, 0.0)
    else:
        memory.start(msg.session, msg.keys, msg.epoch, done)


# How often a `Fetch` carries the engine's link counters (`Fetch.links`): they feed metrics
# (`GetStats`' engines, the server's link gauges), not scheduling, and a snapshot serialized on
# every fetch (each `cluster.fetch_interval_s`) cost the decode loop more than the jitted
# step's dispatch (docs/results.md, "Where a decode step's time goes").
LINKS_EVERY_S = 1.0


class LinkReports:
    """The link counters an engine's fetches carry: while the engine is busy, the JSON snapshot
    of its traffic manager at most every `every_s` seconds (the first fetch's included); while it
    is idle, the snapshot whenever it changed since the last one sent, so the router's stats are
    current once a run's rounds (and their persistence) are done; "" otherwise (the router keeps
    the last one it got) and without a traffic manager."""

    def __init__(self, every_s: float = LINKS_EVERY_S):
        self.every_s = every_s
        self.last = -math.inf
        self.sent = ""

    def due(self, traffic: TrafficManager | None, now: float, busy: bool = True) -> str:
        """What the fetch at `now` carries of `traffic`'s counters (`busy`: the engine has work
        in flight, so the snapshot waits for its interval)."""
        if traffic is None or (busy and now - self.last < self.every_s):
            return ""
        snapshot = json.dumps(traffic.snapshot())
        if not busy and snapshot == self.sent:
            return ""
        self.last, self.sent = now, snapshot
        return snapshot


def register(
    control,
    who,
    address: str,
    params_version: str = "",
    prefill_cost: messages.PrefillCost | None = None,
    runner=None,
    kv_pieces: int = 1,
    kv_piece_addresses: Sequence[str] = (),
    kv_piece_holders: Sequence[Sequence[int]] = (),
) -> None:
    """Announces engine `who` (an `engines.core.EngineId`: its KV channel address, served params
    version, the devices and mesh its `runner` runs on and, for a PE, the prefill cost model it
    batches with, the column pieces its KV rows split into and, spanning processes, where each
    piece of its new rows is offered and which processes hold each) to the router."""
    devices, mesh = runner_devices(runner) if runner is not None else ([], "")
    control.send(
        messages.Register(
            role=who.role,
            engine=who.engine,
            node=who.node,
            group=who.group,
            address=address,
            pid=os.getpid(),
            params_version=params_version,
            prefill_cost=prefill_cost,
            devices=devices,
            mesh=mesh,
            kv_pieces=kv_pieces,
            kv_piece_addresses=list(kv_piece_addresses),
            kv_piece_holders=[list(h) for h in kv_piece_holders],
        )
    )


def runner_devices(runner) -> tuple[list[str], str]:
    """The devices a `ModelRunner` runs on (its mesh's, in mesh order; without one, the
    process's default device) and its mesh in `cluster.prefill_mesh` form ("" for one device)."""
    import jax

    from dualpath_jax.model import sharding

    if runner.mesh is not None:
        return [str(d) for d in runner.mesh.devices.flat], sharding.describe(runner.mesh)
    return [str(jax.local_devices()[0])], ""


def pump(rpc, handle: Callable[[messages.Msg], None], timeout_ms: int) -> None:
    """Handles every message waiting on `rpc` (waiting up to `timeout_ms` for the first)."""
    msg = rpc.recv(timeout_ms)
    while msg is not None:
        handle(msg)
        msg = rpc.recv(0)


def is_stop(msg: messages.Msg) -> bool | None:
    """The messages every engine treats alike: True for a stop order, False for one to ignore
    (acks, stats, logged router errors), None for an engine-specific message."""
    match msg:
        case messages.Stop():
            return True
        case messages.Error(kind="stop", message=text):
            log.error("the router stops this engine: %s", text)
            return True
        case messages.Ack() | messages.Stats():
            return False
        case messages.Error(message=text):
            log.warning("router error: %s", text)
            return False
    return None


def handle_common(engine, msg: messages.Msg) -> None:
    """Carries out the orders a prefill and a decode engine treat alike, after each has matched
    its own: cancel a request, a tool-gap prefetch, a params load or commit, rejoin, the `Ack`
    of its registration, and stop (anything else is logged and ignored). `engine` is a
    `PrefillEngine` or a `DecodeEngine` (`engines.core.Engine` with its requests, context and
    params slot)."""
    match msg:
        case messages.Cancel(request=r):
            engine.drop(r)
        case messages.Prefetch() | messages.DropPrefetch():
            prefetch_order(msg, engine.ctx.prefetch, engine.engine, engine.outbox.put)
        case messages.LoadParams() | messages.CommitParams():
            engine.params.handle(msg, engine.control.send)
        case messages.Error(kind="rejoin", message=why):
            engine.rejoin(why)
        case messages.Ack(ref=ref) if ref == str(engine.engine):
            engine.registering = False  # registered
        case _:
            stop = is_stop(msg)
            if stop is None:
                log.warning("unexpected %s", type(msg).__name__)
            engine.stopped |= bool(stop)


def finish_reads(
    engine: int, request: str, load, node: str, tokens: int, traffic: TrafficManager | None
) -> messages.ReadsDone:
    """A load's storage reads for `request` finished: their `tokens` leave `node`'s read queue
    (in `traffic`, where there is one), and the `ReadsDone` that tells the router so (`load`, a
    `PrefillLoad` or `DecodeLoad`: its attempt, read time and blocks held in memory)."""
    if traffic is not None:
        traffic.read_queue_done(node, tokens)
    return messages.ReadsDone(
        request=request,
        engine=engine,
        attempt=load.job.attempt,
        read_s=load.read_s,
        held_blocks=load.held_blocks,
    )


def failed(request: str, engine: int, exc: BaseException, attempt: int = 0) -> messages.Failed:
    """The `Failed` report of an engine's part of a request, classified by `failure_kind`."""
    log.warning("request %s failed: %s: %s", request, type(exc).__name__, exc)
    return messages.Failed(
        request=request,
        engine=engine,
        message=f"{type(exc).__name__}: {exc}",
        kind=failure_kind(exc),
        attempt=attempt,
    )


def failure_kind(exc: BaseException) -> str:
    """How the router should treat a failure: `transfer` (a peer vanished or stalled: retry),
    `params` (the job's params are not the ones this engine serves: retry elsewhere), `store`
    (the block store failed: report), or `engine` (report)."""
    if isinstance(exc, TransferError | LoadTimeout | LoadCancelled | TimeoutError):
        return "transfer"
    if isinstance(exc, ParamsMismatch):
        return "params"
    if isinstance(exc, StoreError | OSError):
        return "store"
    return "engine"


class RouterSilence:
    """How long the router has left an engine's heartbeats unanswered, counting only the time
    the engine was running to hear it: a stretch in which the heartbeat thread did not run at
    all (the process was stopped, SIGSTOP, or starved), beyond its `interval_s`, is not silence
    of the router, which had no heartbeat to answer. So an engine resumed after a long pause
    gives the router a full `timeout_s` to answer again (it then learns that it was declared
    dead, and registers again) instead of taking it for dead at once."""

    def __init__(self, interval_s: float, timeout_s: float, now: float):
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.heard = self.last = now

    def tick(self, now: float) -> None:
        """The thread runs at `now`: a gap since its last run beyond `interval_s` is not
        counted."""
        self.heard += max(0.0, now - self.last - self.interval_s)
        self.last = now

    def answered(self, now: float) -> None:
        self.heard = now

    def lost(self, now: float) -> float:
        """The router's silence at `now` if it exceeds `timeout_s` (the router is taken for
        dead), else 0 (and always 0 without a timeout)."""
        silent = now - self.heard
        return silent if self.timeout_s and silent > self.timeout_s else 0.0


class HeartbeatThread(threading.Thread):
    """Sends `Heartbeat` to the router every `interval_s` on a socket of its own (zmq sockets are
    per thread), independent of the engine loop, which may block in a compile or a forward.

    The router answers each one; when nothing has come back for `router_timeout_s` of the time
    this thread ran (`RouterSilence`: a paused process does not count its pause), the router is
    taken for dead and `on_router_lost` runs (the engine process stops itself)."""

    def __init__(
        self,
        address: str,
        token: str,
        engine: int,
        interval_s: float,
        router_timeout_s: float = 0.0,
        on_router_lost: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        super().__init__(name=f"heartbeat-{engine}", daemon=True)
        self.address, self.token, self.engine, self.interval_s = address, token, engine, interval_s
        self.router_timeout_s = router_timeout_s
        self.on_router_lost = on_router_lost
        self.clock = clock
        self._halt = threading.Event()

    def run(self) -> None:
        from dualpath_jax.wire.rpc import RpcClient

        rpc = RpcClient(self.address, self.token)
        silence = RouterSilence(self.interval_s, self.router_timeout_s, self.clock())
        try:
            while not self._halt.wait(self.interval_s):
                now = self.clock()
                silence.tick(now)
                rpc.send(messages.Heartbeat(engine=self.engine))
                while True:
                    try:
                        reply = rpc.recv(0)
                    except frames.FrameError:
                        reply = messages.Ack()  # something answered
                    if reply is None:
                        break
                    silence.answered(now)
                silent = silence.lost(now)
                if silent:
                    log.error("no answer from the router at %s for %.1f s", self.address, silent)
                    if self.on_router_lost is not None:
                        self.on_router_lost()
                    return
        finally:
            rpc.close()

    def stop(self) -> None:
        self._halt.set()


def rejoin(engine, why: str) -> None:
    """The router declared `engine` (a prefill or decode engine) dead and requeued its rounds:
    every request it holds is dropped and it registers again, its staged params load dropped
    too. Orders that answer messages sent before that `Register` (they arrive before its `Ack`)
    are ignored (`engine.registering`)."""
    if engine.registering:
        return
    log.warning("%s: %s (dropping %d requests)", engine.who.name, why, len(engine.reqs))
    for rid in list(engine.reqs):
        engine.drop(rid)
    if getattr(engine.ctx, "prefetch", None) is not None:
        engine.ctx.prefetch.clear()  # the router forgot what it asked for
    engine.params.drop_staged()
    engine.register()
