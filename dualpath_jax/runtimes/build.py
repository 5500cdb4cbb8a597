"""Assembling engines and the router from a config: the one place their parts are wired.

What an engine needs from its runtime is a `Transport`: the router's control address and
secret, a KV channel factory, the devices its mesh spans and what to do when the router is lost.
`build_engine` wires the rest (model on its mesh, store, host buffer, traffic, loader context,
params slot, heartbeat) the same way for every runtime: a process of `LocalCluster` or
`launch/engine.py` (`runtimes.process`) and a thread of `InProcessCluster` (`runtimes.inprocess`).
`build_router` does the same for the router (scheduler, control socket, store, event log, KV
event publisher).

Lifecycle: `build_engine` returns a `BuiltEngine`; `run()` drives it (`engines.core.drive`)
until the router stops it (or `halt` is set), `close()` releases everything it opened (sockets,
channel, store, pool) and writes its link report. `BuiltRouter` likewise: `serve()`, `close()`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import pathlib
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import TYPE_CHECKING, Any

from dualpath_jax.config import ExperimentConfig, StoreConfig
from dualpath_jax.engines.common import HeartbeatThread
from dualpath_jax.engines.core import ROLES, Engine, EngineId, drive
from dualpath_jax.kv_events import KVEvent
from dualpath_jax.kvstore.store import TensorStoreBlockStore, open_block_store
from dualpath_jax.wire import messages

if TYPE_CHECKING:
    from dualpath_jax.engines.span import MirrorLeader
    from dualpath_jax.sched.scheduler import GlobalScheduler
    from dualpath_jax.transfer.channel import KVChannel

log = logging.getLogger(__name__)


def store_config(cfg: ExperimentConfig, workdir: str) -> StoreConfig:
    """The cluster's store config, its root defaulting to `workdir/store`."""
    root = cfg.store.root or str(pathlib.Path(workdir) / "store")
    return dataclasses.replace(cfg.store, root=root)


def open_store(
    cfg: ExperimentConfig,
    workdir: str,
    on_events: Callable[[list[KVEvent]], None] | None = None,
) -> TensorStoreBlockStore:
    return open_block_store(store_config(cfg, workdir), cfg.model, on_events=on_events)


@dataclasses.dataclass(frozen=True)
class Transport:
    """How an engine reaches the rest of its cluster.

    `router_address`/`token`: the router's control endpoint and the engine secret.
    `channel(bind_host)`: a new KV channel for this engine. `devices`: the devices its mesh
    spans (None: this process's local devices). `on_router_lost`: called once the router has
    not answered heartbeats for `cluster.heartbeat_timeout_s` (a process stops itself, a
    thread ends its loop). `span`: makes the leader of an engine spanning processes (called
    after a PE's calibration, which its followers run in step), or None."""

    router_address: str
    token: str
    channel: Callable[[str], KVChannel]
    devices: Sequence[Any] | None = None
    on_router_lost: Callable[[], None] | None = None
    span: Callable[[], MirrorLeader] | None = None
    spans_processes: bool = False


@dataclasses.dataclass
class BuiltEngine:
    """An assembled engine and what it owns. `run()` drives it; `close()` releases it all."""

    engine: Engine
    heartbeat: HeartbeatThread
    closers: list[Callable[[], None]]
    halt: threading.Event = dataclasses.field(default_factory=threading.Event)
    gate: threading.Event | None = None  # (`drive`'s: an in-process runtime's freeze)

    def run(self) -> None:
        drive(self.engine, self.halt, self.gate)

    def close(self) -> None:
        self.heartbeat.stop()
        for close in reversed(self.closers):
            try:
                close()
            except Exception:  # noqa: BLE001 - release the rest
                log.exception("closing %s", self.engine.who.name)

    def __enter__(self) -> BuiltEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_engine(
    cfg: ExperimentConfig, who: EngineId, workdir: str, transport: Transport
) -> BuiltEngine:
    """Assembles engine `who` of `cfg` (its model on its mesh, store, host buffer, channel,
    traffic manager, loader context, params slot and heartbeat). A PE fits its prefill cost
    model here unless `cluster.prefill_cost_json` pins one (before it registers: the router
    derives beta from what PEs report)."""
    import jax

    from dualpath_jax.engines.calibrate import prefill_cost
    from dualpath_jax.engines.decode_engine import DecodeEngine, make_decoder
    from dualpath_jax.engines.fault_hook import fault_injection
    from dualpath_jax.engines.params import ParamsSlot, load_served_model
    from dualpath_jax.engines.prefill_engine import PrefillEngine
    from dualpath_jax.engines.span import MirroredDecoder
    from dualpath_jax.engines.warmup import warm_decoder, warm_prefill
    from dualpath_jax.kvstore.buffers import HostBufferPool
    from dualpath_jax.model import sharding
    from dualpath_jax.model.layout import BlockLayout
    from dualpath_jax.model.runner import ModelRunner
    from dualpath_jax.runtimes.devices import role_mesh
    from dualpath_jax.transfer.loader import LoaderContext
    from dualpath_jax.transfer.prefetch_memory import PrefetchMemory
    from dualpath_jax.transfer.row_offers import RowOffers
    from dualpath_jax.transfer.traffic import TrafficManager
    from dualpath_jax.wire.params_protocol import initial_params_version
    from dualpath_jax.wire.rpc import RpcClient, check_transfer_bind, host_port

    c = cfg.cluster
    if who.role not in ROLES:
        raise ValueError(f"unknown engine role {who.role!r}; expected one of {ROLES}")
    devices = list(transport.devices) if transport.devices is not None else jax.local_devices()
    mesh = sharding.make_mesh(role_mesh(c, who.role), devices)
    log.info(
        "%s engine %d on node %d: mesh %r over %s",
        who.role,
        who.engine,
        who.node,
        sharding.describe(mesh),
        list(mesh.devices.flat) if mesh is not None else devices[:1],
    )
    runner = ModelRunner(load_served_model(cfg, mesh))
    check_transfer_bind(c.transfer_host, c.transfer_untrusted_network_ok)
    closers: list[Callable[[], None]] = []
    params = ParamsSlot(
        runner,
        initial_params_version(c),
        who.engine,
        load_timeout_s=c.params_load_timeout_s,
    )
    layout = BlockLayout.for_model(cfg.model, cfg.store.block_tokens)
    faults = fault_injection(c.fault_file, who.name)
    # Messages from the engine's other threads; the store's KV events go there too, so they
    # reach the router ahead of whatever the engine reports after the store acted.
    outbox: queue.Queue[messages.Msg] = queue.Queue()

    def forward_events(evs) -> None:
        outbox.put(messages.KVEvents(engine=who.engine, events=evs))

    store = faults.store(open_store(cfg, workdir, forward_events if c.kv_events_address else None))
    closers.append(store.close)
    buffer = HostBufferPool.for_config(
        cfg, layout, "PE buffer" if who.role == "prefill" else "DE buffer"
    )
    channel = faults.channel(transport.channel(host_port(c.transfer_host, 0)))
    closers.append(channel.close)
    # A streamed params update (transfer/params_sync.py) is pulled over the KV channel.
    params.channel, params.corrupt_bucket = channel, faults.params_bucket
    traffic = TrafficManager(cfg.hardware)
    closers.append(traffic.close)
    closers.append(
        lambda: write_link_report(
            pathlib.Path(workdir) / "links" / f"{who.name}.json", who, traffic
        )
    )
    pool = futures.ThreadPoolExecutor(16, thread_name_prefix=who.name)
    closers.append(lambda: pool.shutdown(wait=False, cancel_futures=True))
    ctx = LoaderContext(
        cfg.model,
        layout,
        store,
        buffer,
        channel,
        traffic,
        pool,
        timeout_s=c.transfer_timeout_s,
        start_timeout_s=c.prefill_start_timeout_s,
        owners=frozenset({who.name, f"node{who.node}"}),
        # Spanning processes, the leader moves KV whole through its own device and the host.
        mesh=None if transport.spans_processes else runner.mesh,
    )
    control = RpcClient(transport.router_address, transport.token)
    closers.append(control.close)
    heartbeat = HeartbeatThread(
        transport.router_address,
        transport.token,
        who.engine,
        c.heartbeat_s,
        router_timeout_s=c.router_timeout_s or c.heartbeat_timeout_s,
        on_router_lost=transport.on_router_lost,
    )
    built = BuiltEngine(_Unbuilt(who), heartbeat, closers)  # type: ignore[arg-type]
    heartbeat.start()
    try:
        # Before registering: the router derives beta from the model a PE reports (spanning
        # processes, the followers run these forwards in step, before they follow).
        cost = prefill_cost(cfg, runner) if who.role == "prefill" else None
        leader = transport.span() if transport.span is not None else None
        if leader is not None:
            closers.append(leader.close)
            params.mirror = leader  # its followers load and commit updates with it
            if who.role == "prefill":  # each process offers the DE its pieces of the new rows
                ctx.row_offers = RowOffers.for_mesh(
                    cfg.model, runner.mesh, leader.kv_addresses(channel.address)
                )
        warm = c.warmup and leader is None
        if c.warmup and leader is not None:
            log.warning("%s spans processes: cluster.warmup is not supported there", who.name)
        if cfg.scheduler.prefetch:  # a tool-gap prefetch may read into either role's memory
            ctx.prefetch = PrefetchMemory.for_engine(cfg, who.node, layout, store, traffic)
            closers.append(ctx.prefetch.close)
        if who.role == "prefill":
            if warm:
                log.info("%s warm-up: %s", who.name, warm_prefill(cfg, runner, buffer).describe())
            built.engine = PrefillEngine(
                cfg, who, control, ctx, runner, params, cost, outbox=outbox, span=leader
            )
        else:
            decoder = make_decoder(cfg, runner)
            if warm:
                log.info("%s warm-up: %s", who.name, warm_decoder(cfg, decoder, buffer).describe())
            if leader is not None:
                decoder = MirroredDecoder(decoder, leader)
            built.engine = DecodeEngine(cfg, who, control, ctx, decoder, params, outbox=outbox)
        if warm:
            # The warm-up reached every shape: a compile from here on is a gap in it, which
            # stalls serving for its duration. JAX then logs each one, with its program.
            jax.config.update("jax_log_compiles", True)
            log.info("%s: compiles after the warm-up are logged (jax_log_compiles)", who.name)
    except BaseException:
        built.close()
        raise
    return built


@dataclasses.dataclass
class _Unbuilt:
    """Stands in for an engine whose construction failed, so `close` can name it."""

    who: EngineId


def write_link_report(path: pathlib.Path, who: EngineId, traffic) -> None:
    """The engine's per-link counters and byte time series (0.1 s windows, times on this host's
    monotonic clock) for the run summary."""
    windows = {
        lid.name: [[traffic.origin + t, b] for t, b in traffic.window_bytes(lid)]
        for lid in traffic.links()
    }
    report = {
        "role": who.role,
        "engine": who.engine,
        "node": who.node,
        "snapshot": traffic.snapshot(),
        "windows": windows,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(report))
    os.replace(tmp, path)


@dataclasses.dataclass
class BuiltRouter:
    """An assembled router and what it owns. `serve()` runs it until a `Shutdown`; `close()`
    releases its socket, store, event log and KV-event publisher."""

    router: Any  # engine.router.Router
    address: str
    closers: list[Callable[[], None]]

    def serve(self, until: Callable[[], bool] | None = None) -> None:
        self.router.serve(until)

    def close(self) -> None:
        for close in reversed(self.closers):
            try:
                close()
            except Exception:  # noqa: BLE001 - release the rest
                log.exception("closing the router")

    def __enter__(self) -> BuiltRouter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def router_scheduler(cfg: ExperimentConfig) -> GlobalScheduler:
    """The router's scheduler for `cfg`: alpha from the hardware, beta from the config until PEs
    report their cost models (then `Dispatch.update_beta` derives it), and load or recompute
    pricing reads at the storage NIC's rate where it is emulated; where it is not (rate 0) the
    rule has no rate, so it loads, until the router has measured one (`dispatch.ReadRate`)."""
    from dualpath_jax.model.layout import kv_bytes_per_token
    from dualpath_jax.sched.cost import derive_alpha, engines_beta
    from dualpath_jax.sched.scheduler import GlobalScheduler

    c = cfg.cluster
    kvb = kv_bytes_per_token(cfg.model)
    snic = cfg.hardware.snic_bytes_per_s
    return GlobalScheduler.from_config(
        cfg.scheduler,
        alpha=derive_alpha(cfg.scheduler, cfg.hardware, kvb),
        beta=engines_beta(cfg.scheduler, (), max_batch=c.prefill_max_batch or 256),
        block_tokens=cfg.store.block_tokens,
        pe_read_rate=snic or 1.0,
        de_read_rate=snic or 1.0,
        de_max_seqs=c.decode_slots + c.decode_queue,
        read_tokens_per_s=snic / kvb if snic else 0.0,
    )


def build_router(
    cfg: ExperimentConfig, workdir: str, endpoint: str = "", resume: bool = False
) -> BuiltRouter:
    """Assembles the router of `cfg`: its scheduler (alpha from the hardware; beta from the
    config until PEs report their cost models), control socket (on `cluster.host` and
    `cluster.router_port`, or on `endpoint`, e.g. an `inproc://` one), store, event log
    (`workdir/events.jsonl`) and KV-event publisher (`cluster.kv_events_address`). `resume`: a
    router restarted over running engines, serving the params recorded in
    `workdir/served_params.json` (`SERVED_FILE`) by its predecessor."""
    from dualpath_jax.engines.fault_hook import fault_injection
    from dualpath_jax.metrics.events import EventLog
    from dualpath_jax.router.kv_publisher import KVEventPublisher
    from dualpath_jax.router.router import Router
    from dualpath_jax.wire.credentials import credentials_for
    from dualpath_jax.wire.params_protocol import SERVED_FILE
    from dualpath_jax.wire.rpc import RpcServer

    c = cfg.cluster
    sched = router_scheduler(cfg)
    closers: list[Callable[[], None]] = []
    try:
        creds = credentials_for(c.secrets_file)
        server = RpcServer(c.host, c.router_port, creds.tokens, endpoint=endpoint)
        closers.append(server.close)
        publisher = None
        if c.kv_events_address:
            publisher = KVEventPublisher(c.kv_events_address, creds.tokens)
            closers.append(publisher.close)
            log.info("publishing KV events on %s", publisher.address)
        on_events = None if publisher is None else functools.partial(publisher.post, "router")
        store = fault_injection(c.fault_file, "router").store(open_store(cfg, workdir, on_events))
        closers.append(store.close)
        events = EventLog(pathlib.Path(workdir) / "events.jsonl", c.events_max_bytes, c.events_keep)
        closers.append(events.close)
        router = Router(
            cfg,
            server,
            store,
            sched,
            events,
            kv_events=publisher,
            served_file=str(pathlib.Path(workdir) / SERVED_FILE),
            resume=resume,
        )
    except BaseException:
        BuiltRouter(None, "", closers).close()
        raise
    log.info("router listening on %s (policy %s)", server.address, cfg.scheduler.policy.value)
    return BuiltRouter(router, server.address, closers)
