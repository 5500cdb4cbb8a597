"""Building and running one cluster process (router, prefill or decode) from an ExperimentConfig.

`launch/engine.py` and `LocalCluster` both call `run_process`; everything a process needs arrives
as arguments (no environment reads). The router writes its control address to `address_file`
once it is listening, which is how a local launcher finds it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import pathlib
import queue
import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures

from dualpath_jax.config import ExperimentConfig, StoreConfig
from dualpath_jax.engine.credentials import credentials_for
from dualpath_jax.engine.devices import role_mesh
from dualpath_jax.engine.rpc import check_transfer_bind, host_port
from dualpath_jax.kv_events import KVEvent
from dualpath_jax.kvstore.store import TensorStoreBlockStore, open_block_store
from dualpath_jax.model.layout import BlockLayout, kv_bytes_per_token

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    """Which process to run. Engine ids are unique across roles; nodes too."""

    role: str  # router | prefill | decode
    workdir: str
    router_address: str = ""  # engines: tcp://host:port of the router
    engine: int = 0
    node: int = 0
    group: int = 0
    address_file: str = ""  # router: where to write the address it listens on
    parent_pid: int = 0  # if set: stop when this process is no longer our parent (it died)
    # An engine spanning several processes (`engine.span`): this one's rank, how many, and the
    # group's jax.distributed coordinator (host:port, served by rank 0).
    span_rank: int = 0
    span_size: int = 1
    coordinator: str = ""


def store_config(cfg: ExperimentConfig, workdir: str) -> StoreConfig:
    root = cfg.store.root or str(pathlib.Path(workdir) / "store")
    return dataclasses.replace(cfg.store, root=root)


def open_store(
    cfg: ExperimentConfig,
    workdir: str,
    on_events: Callable[[list[KVEvent]], None] | None = None,
) -> TensorStoreBlockStore:
    return open_block_store(store_config(cfg, workdir), cfg.model, on_events=on_events)


def _install_sigterm(stop: threading.Event) -> None:
    def handler(signum, frame):  # noqa: ARG001
        stop.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def _watch_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """Stops this process (as SIGTERM does) once `parent_pid` is no longer its parent: a
    `LocalCluster` whose owner was killed must not leave engines behind."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        log.warning("parent process %d is gone: stopping", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run_router(cfg: ExperimentConfig, spec: ProcessSpec) -> None:
    from dualpath_jax.engine.fault_hook import fault_injection
    from dualpath_jax.engine.kv_publisher import KVEventPublisher
    from dualpath_jax.engine.router import Router
    from dualpath_jax.engine.rpc import RpcServer
    from dualpath_jax.metrics.events import EventLog
    from dualpath_jax.sched.cost import derive_alpha, engines_beta
    from dualpath_jax.sched.scheduler import GlobalScheduler

    kvb = kv_bytes_per_token(cfg.model)
    alpha = derive_alpha(cfg.scheduler, cfg.hardware, kvb)
    snic = cfg.hardware.snic_bytes_per_s
    sched = GlobalScheduler.from_config(
        cfg.scheduler,
        alpha=alpha,
        # Until a PE reports its cost model (then Router.update_beta derives beta from it).
        beta=engines_beta(cfg.scheduler, (), max_batch=cfg.cluster.prefill_max_batch or 256),
        block_tokens=cfg.store.block_tokens,
        pe_read_rate=snic or 1.0,
        de_read_rate=snic or 1.0,
        de_max_seqs=cfg.cluster.decode_slots + cfg.cluster.decode_queue,
        read_tokens_per_s=snic / kvb if snic else 0.0,
    )
    creds = credentials_for(cfg.cluster.secrets_file)
    server = RpcServer(cfg.cluster.host, cfg.cluster.router_port, creds.tokens)
    publisher = None
    if cfg.cluster.kv_events_address:
        publisher = KVEventPublisher(cfg.cluster.kv_events_address, creds.tokens)
        log.info("publishing KV events on %s", publisher.address)
    on_events = None if publisher is None else functools.partial(publisher.post, "router")
    faults = fault_injection(cfg.cluster.fault_file, "router")
    store = faults.store(open_store(cfg, spec.workdir, on_events))
    events = EventLog(pathlib.Path(spec.workdir) / "events.jsonl")
    router = Router(cfg, server, store, sched, events, kv_events=publisher)
    if spec.address_file:
        tmp = spec.address_file + ".tmp"
        pathlib.Path(tmp).write_text(server.address)
        os.replace(tmp, spec.address_file)
    log.info("router listening on %s (policy %s)", server.address, cfg.scheduler.policy.value)
    try:
        router.serve()
    finally:
        events.close()
        store.close()
        if publisher is not None:
            publisher.close()
        server.close()


def run_engine(cfg: ExperimentConfig, spec: ProcessSpec) -> None:
    import jax

    from dualpath_jax.engine import messages as M
    from dualpath_jax.engine.calibrate import prefill_cost
    from dualpath_jax.engine.common import HeartbeatThread
    from dualpath_jax.engine.decode_engine import DecodeEngine, make_decoder
    from dualpath_jax.engine.fault_hook import fault_injection
    from dualpath_jax.engine.params import ParamsSlot, initial_params_version, load_served_model
    from dualpath_jax.engine.prefill_engine import PrefillEngine, PrefillReplay
    from dualpath_jax.engine.rpc import RpcClient
    from dualpath_jax.engine.span import (
        DecoderReplay,
        MirroredDecoder,
        MirrorLeader,
        Span,
        follow,
        init_distributed,
    )
    from dualpath_jax.kvstore.buffers import HostBufferPool
    from dualpath_jax.model import sharding
    from dualpath_jax.model.runner import ModelRunner
    from dualpath_jax.sched.cost import FittedCostModel
    from dualpath_jax.transfer.channel import JaxTransferChannel
    from dualpath_jax.transfer.loader import LoaderContext
    from dualpath_jax.transfer.traffic import TrafficManager

    c = cfg.cluster
    span = Span(spec.span_rank, spec.span_size, spec.coordinator)
    if span.spans:  # before anything else starts JAX: this engine's own process group
        init_distributed(
            span, c.platform, bind_host=c.transfer_host, timeout_s=c.heartbeat_timeout_s * 4
        )
    # The engine's mesh over the devices its process was given (`engine.devices`); an engine
    # spanning processes meshes over all of theirs.
    visible = jax.local_devices()
    mesh = sharding.make_mesh(role_mesh(c, spec.role), jax.devices() if span.spans else visible)
    log.info(
        "%s engine %d on node %d: mesh %r over %s (%d device(s) visible)",
        spec.role,
        spec.engine,
        spec.node,
        sharding.describe(mesh),
        list(mesh.devices.flat) if mesh is not None else visible[:1],
        len(visible),
    )
    runner = ModelRunner(load_served_model(cfg, mesh))
    if span.spans and not span.leader:  # replays the leader's device work; nothing else
        log.info(
            "%s engine %d: process %d of %d follows", spec.role, spec.engine, span.rank, span.size
        )
        if spec.role == "prefill":
            prefill_cost(cfg, runner)  # the leader's calibration forwards, in step with it
            replay = PrefillReplay(cfg, runner)
        else:
            replay = DecoderReplay(runner, _follower_decoder)
        follow(replay, timeout_s=c.heartbeat_timeout_s)
        return
    creds = credentials_for(c.secrets_file)
    check_transfer_bind(c.transfer_host, c.transfer_untrusted_network_ok)
    params = ParamsSlot(runner, initial_params_version(c), spec.engine)
    layout = BlockLayout.for_model(cfg.model, cfg.store.block_tokens)
    prefix = "pe" if spec.role == "prefill" else "de"
    who = f"{prefix}{spec.engine}"
    faults = fault_injection(c.fault_file, who)
    # Messages from the engine's other threads; the store's KV events go there too, so they
    # reach the router ahead of whatever the engine reports after the store acted.
    outbox: queue.Queue[M.Msg] = queue.Queue()

    def forward_events(evs: list[KVEvent]) -> None:
        outbox.put(M.KVEvents(engine=spec.engine, events=evs))

    on_events = forward_events if c.kv_events_address else None
    store = faults.store(open_store(cfg, spec.workdir, on_events))
    name = "PE buffer" if spec.role == "prefill" else "DE buffer"
    buffer = HostBufferPool.for_config(cfg, layout, name)
    bind = host_port(c.transfer_host, 0)
    channel = faults.channel(JaxTransferChannel(bind=bind, transport_addresses=[bind]))
    traffic = TrafficManager(cfg.hardware)
    pool = futures.ThreadPoolExecutor(16, thread_name_prefix=f"{spec.role}{spec.engine}")
    ctx = LoaderContext(
        cfg.model,
        layout,
        store,
        buffer,
        channel,
        traffic,
        pool,
        timeout_s=cfg.cluster.transfer_timeout_s,
        start_timeout_s=cfg.cluster.prefill_start_timeout_s,
        owners=frozenset({f"{prefix}{spec.engine}", f"node{spec.node}"}),
        # Spanning processes, the leader moves KV whole through its own device and the host.
        mesh=None if span.spans else runner.mesh,
    )
    rpc = RpcClient(spec.router_address, creds.engine)
    heartbeat = HeartbeatThread(
        spec.router_address,
        creds.engine,
        spec.engine,
        c.heartbeat_s,
        router_timeout_s=c.heartbeat_timeout_s,
        on_router_lost=lambda: os.kill(os.getpid(), signal.SIGTERM),
    )
    heartbeat.start()
    leader = None
    try:
        # Before registering: the router derives beta from the model a PE reports (spanning
        # processes, the followers run these forwards in step, before they follow).
        reported = prefill_cost(cfg, runner) if spec.role == "prefill" else None
        if span.spans:
            leader = MirrorLeader(span, c.host, timeout_s=c.heartbeat_timeout_s * 4)
            params.mirror = leader  # its followers load and commit updates with it
        if spec.role == "prefill":
            cost = FittedCostModel(prefill=reported.prefill)
            engine = PrefillEngine(
                cfg,
                spec.engine,
                spec.node,
                spec.group,
                rpc,
                runner,
                ctx,
                attention_time=cost.attention_time,
                params=params,
                prefill_cost=reported,
                outbox=outbox,
                span=leader,
            )
        else:
            decoder = make_decoder(cfg, runner)
            if leader is not None:
                decoder = MirroredDecoder(decoder, leader)
            engine = DecodeEngine(
                cfg,
                spec.engine,
                spec.node,
                spec.group,
                rpc,
                decoder,
                ctx,
                params=params,
                outbox=outbox,
            )
        engine.run()
    finally:
        if leader is not None:
            leader.close()
        heartbeat.stop()
        write_link_report(
            pathlib.Path(spec.workdir) / "links" / f"{prefix}{spec.engine}.json", spec, traffic
        )
        rpc.close()
        pool.shutdown(wait=False, cancel_futures=True)
        channel.close()
        traffic.close()
        store.close()


def _follower_decoder(runner, *, slots, max_len, min_bucket, page_size, num_pages):
    """A follower's `Decoder`, shaped as its leader's (`MirroredDecoder` sends the shape)."""
    from dualpath_jax.model.decode import Decoder

    return Decoder(runner, slots, max_len, min_bucket, page_size=page_size, num_pages=num_pages)


def write_link_report(path: pathlib.Path, spec: ProcessSpec, traffic) -> None:
    """The engine's per-link counters and byte time series (0.1 s windows, times on this host's
    monotonic clock) for the run summary."""
    import json

    windows = {
        lid.name: [[traffic.origin + t, b] for t, b in traffic.window_bytes(lid)]
        for lid in traffic.links()
    }
    report = {
        "role": spec.role,
        "engine": spec.engine,
        "node": spec.node,
        "snapshot": traffic.snapshot(),
        "windows": windows,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report))
    os.replace(tmp, path)


def run_process(cfg: ExperimentConfig, spec: ProcessSpec) -> None:
    stop = threading.Event()
    _install_sigterm(stop)
    if spec.parent_pid:
        _watch_parent(spec.parent_pid)
    try:
        if spec.role == "router":
            run_router(cfg, spec)
        elif spec.role in ("prefill", "decode"):
            run_engine(cfg, spec)
        else:
            raise ValueError(f"unknown role {spec.role!r}; expected router, prefill or decode")
    except KeyboardInterrupt:
        log.info("%s stopped by signal", spec.role)
